"""``still_needed``: how a test says that the upstream bug a patch works around is still there, or that the patch can
go (tests/unit/test_upstream_bugs.py lists which test shows each patch's bug)."""

from trl_ext import patches


def still_needed(name: str, bug_shows: bool, what: str) -> None:
    """Assert that the upstream behaviour patch ``name`` works around still shows; else say to remove the patch.

    Args:
        name: the patch, a key of ``trl_ext.patches.PATCHES``.
        bug_shows: whether the upstream bug showed, run without the patch on the installed release.
        what: what was looked at, for the message.
    """
    patch = patches.PATCHES[name]
    assert bug_shows, (
        f"upstream no longer shows what patch '{name}' works around ({what}) in the installed release: remove the "
        f"'{name}' patch from trl_ext/patches.py and its use ({patch.target}); it was to go when: {patch.remove_when}.")
