"""k8s.io/apimachinery pkg/util/validation, as the webhooks call it: the DNS-label, subdomain, label-value,
qualified-name and domain-prefixed-path checks, with apimachinery's messages, the scaling of an int-or-percent
(pkg/util/intstr), and the few pod-template reads the projects' rules share (jobset.py, trainer.py, lws.py, kuberay.py).
"""

import math
import re

MAX_INT32 = 2**31 - 1

DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS1123_LABEL_FMT = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN = re.compile(rf"{DNS1123_LABEL_FMT}(\.{DNS1123_LABEL_FMT})*")
QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
HTTP_PATH = re.compile(r"[A-Za-z0-9/\-._~%!$&'()*+,;=:]+")
PERCENT = re.compile(r"[0-9]+%")
MAX_LEN_63 = "must be no more than 63 characters"
DNS1035_MSG = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
               "character, and end with an alphanumeric character")
DNS1123_SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
                         "'.', and must start and end with an alphanumeric character")
LABEL_VALUE_MSG = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and "
                   "must start and end with an alphanumeric character")


def dns1035_label(value: str) -> list[str]:
    """`IsDNS1035Label`: the names of Services, and of everything named after them."""
    return ([MAX_LEN_63] if len(value) > 63 else []) + ([] if DNS1035_LABEL.fullmatch(value) else [DNS1035_MSG])


def dns1123_subdomain(value: str) -> list[str]:
    too_long = ["must be no more than 253 characters"] if len(value) > 253 else []
    return too_long + ([] if DNS1123_SUBDOMAIN.fullmatch(value) else [DNS1123_SUBDOMAIN_MSG])


def label_value(value: str) -> list[str]:
    return ([MAX_LEN_63] if len(value) > 63 else []) + ([] if LABEL_VALUE.fullmatch(value) else [LABEL_VALUE_MSG])


def qualified_name(key: str) -> list[str]:
    """`IsQualifiedName` (a label key): an optional DNS-1123 subdomain prefix and `/`, then a name of 63 at most."""
    parts = key.split("/")
    if len(parts) > 2:
        return ["a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
                "with an alphanumeric character, with an optional DNS subdomain prefix and '/'"]
    errors = [f"prefix part {e}" for e in dns1123_subdomain(parts[0])] if len(parts) == 2 else []
    if not parts[-1] or len(parts[-1]) > 63 or not QUALIFIED_NAME.fullmatch(parts[-1]):
        errors.append("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
                      "with an alphanumeric character (63 characters at most)")
    return errors


def domain_prefixed_path(value: str) -> list[str]:
    """`IsDomainPrefixedPath`: `acme.io/foo`, a DNS-1123 subdomain, `/`, then an HTTP path."""
    if not value:
        return ["Required value"]
    host, slash, path = value.partition("/")
    if not slash or not host or not path:
        return ['must be a domain-prefixed path (such as "acme.io/foo")']
    return dns1123_subdomain(host) + ([] if HTTP_PATH.fullmatch(path) else ["Invalid path"])


def scaled_int_or_percent(value, total: int, round_up: bool) -> int | None:
    """`intstr.GetScaledValueFromIntOrPercent` (k8s.io/apimachinery pkg/util/intstr): None where upstream errs."""
    if isinstance(value, int):
        return value
    if not (isinstance(value, str) and value.endswith("%") and value[:-1].lstrip("-").isdigit()):
        return None
    scaled = int(value[:-1]) * total / 100
    return math.ceil(scaled) if round_up else math.floor(scaled)


def env_names(container: dict) -> set[str]:
    return {env.get("name") for env in container.get("env") or []}


def pod_spec(template: dict | None) -> dict:
    return (template or {}).get("spec") or {}
