"""The mirror's address and storage options as a config holds them: a URL fsspec understands, and options whose
secrets never sit in the config itself.

A config is logged (``to_dict``: TensorBoard's hyperparameters, the console), pickled into every checkpoint
(``training_args.bin``, which the mirror then uploads) and copied. So a secret given in ``mirror_storage_options``
(``key``, ``secret``, ``token``, ``account_key``, ...) is replaced there by a placeholder, and the value is kept in this
process only (``conceal``); the store gets the real values (``reveal``). The standard credential chains (environment
variables, ``~/.aws/credentials``, instance roles, ``gcloud`` and ``az`` logins, ``HF_TOKEN``) need no options at all.
"""

import json
import re
import uuid

from trl_ext.errors import ConfigError

# Option names that hold secrets in fsspec's backends (s3fs: key, secret, token; gcsfs: token; adlfs: account_key,
# sas_token, client_secret, connection_string; huggingface_hub: token; http: password, headers' Authorization).
_SECRET_NAME = re.compile(r"(^|_)(key|secret|token|password|passwd|credentials?|connection_string|authorization)$",
                          re.IGNORECASE)
_PLACEHOLDER = re.compile(r"^<hidden [0-9a-f]{12}>$")
_hidden: dict[str, object] = {}  # placeholder -> the secret, in this process only


def is_secret(name: str) -> bool:
    """Whether an option called ``name`` holds a secret (never logged, never pickled)."""
    return bool(_SECRET_NAME.search(str(name)))


def conceal(options):
    """``options`` with every secret value replaced by a placeholder that ``reveal`` turns back in this process.

    Args:
        options: storage options (nested dicts allowed, as s3fs's ``client_kwargs``).

    Returns:
        The same structure, secrets replaced (values already concealed are kept).
    """
    if not isinstance(options, dict):
        return options
    out = {}
    for name, value in options.items():
        if isinstance(value, dict):
            out[name] = conceal(value)
        elif is_secret(name) and value is not None and not (isinstance(value, str) and _PLACEHOLDER.match(value)):
            placeholder = f"<hidden {uuid.uuid4().hex[:12]}>"
            _hidden[placeholder] = value
            out[name] = placeholder
        else:
            out[name] = value
    return out


def reveal(options):
    """The storage options with their secrets put back (``conceal``'s inverse, in the process that concealed them).

    Args:
        options: options as a config holds them.

    Returns:
        The options to hand to fsspec.

    Raises:
        ConfigError: a placeholder from another process (a pickled config): its secret is not known here.
    """
    if not isinstance(options, dict):
        return options
    out = {}
    for name, value in options.items():
        if isinstance(value, dict):
            out[name] = reveal(value)
        elif isinstance(value, str) and _PLACEHOLDER.match(value):
            if value not in _hidden:
                raise ConfigError(f"mirror_storage_options['{name}'] was hidden in another process and is not known "
                                  "here: pass it again, or use the store's standard credentials (environment "
                                  "variables, config files, instance roles)")
            out[name] = _hidden[value]
        else:
            out[name] = value
    return out


def parse(value) -> dict:
    """``mirror_storage_options`` as given: a dict (Python, YAML), a JSON object (the command line) or None.

    Args:
        value: the option's value.

    Returns:
        A dict (empty for None), its secrets concealed.

    Raises:
        ConfigError: not a JSON object.
    """
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"mirror_storage_options is not JSON ({exc.msg}): pass an object, e.g. "
                              "'{\"endpoint_url\": \"https://...\"}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"mirror_storage_options must be a mapping of fsspec storage options, not "
                          f"{type(value).__name__}")
    return conceal(value)


def shown(url: str) -> str:
    """The URL as logs show it: credentials embedded in it (``s3://KEY:SECRET@bucket``) removed."""
    return re.sub(r"^([a-zA-Z][\w+.-]*://)[^/@]*@", r"\1", url)


def check_url(url: str) -> str:
    """``checkpoint_mirror`` checked for its shape: a URL with a protocol (``s3://bucket/prefix``), or a local path.

    Args:
        url: the option's value.

    Returns:
        The URL without a trailing slash.

    Raises:
        ConfigError: an empty URL or one that names only a protocol.
    """
    url = str(url).strip()
    stripped = url.rstrip("/")
    if not stripped or stripped.endswith(":") or stripped.endswith("://") or re.fullmatch(r"[\w+.-]+://", url):
        raise ConfigError(f"checkpoint_mirror '{url}' names no bucket or folder: give one, e.g. "
                          "checkpoint_mirror='s3://my-bucket/my-run'")
    return stripped
