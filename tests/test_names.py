"""The rules for client-supplied names (shardps.names): pure units, no servers."""

import pytest

from shardps import names
from shardps.errors import FailedPrecondition, InvalidArgument

KINDS = [names.JOB, names.TABLE, names.CHECKPOINT_ID, names.WORKER, names.SERVER]


@pytest.mark.parametrize("name", ["team-a", "scr_3", "w", "1.bias", "fc3.bias", "emb.weight",
                                  "conv1.weight", "step-20", "manual-1700000000000", "shardps-server-0",
                                  "worker-0.example.internal", "A" * 64])
def test_the_names_in_use_follow_every_rule(name):
    for kind in KINDS:
        assert names.check(kind, name, "field") == name


@pytest.mark.parametrize("name", ["", ".", "..", "../etc", "a/b", "a\\b", "x/../y", "a..b", ".hidden",
                                  "-rf", "_x", "a b", "a\0b", "a\n", "\nb", "a\t", "\u00fc", "a:b",
                                  "x" * 129])
def test_names_breaking_the_rule_are_refused_naming_field_value_and_rule(name):
    for kind in KINDS:
        with pytest.raises(InvalidArgument) as err:
            names.check(kind, name, "spec.name")
        assert "spec.name=" in err.value.message and repr(name) in err.value.message
        assert names.RULE in err.value.message


def test_lengths_and_optional_names():
    assert names.is_valid(names.TABLE, "x" * 128) and not names.is_valid(names.TABLE, "x" * 129)
    assert names.is_valid(names.JOB, "x" * 64) and not names.is_valid(names.JOB, "x" * 65)
    assert names.check_optional(names.WORKER, "", "name") == ""
    with pytest.raises(InvalidArgument):
        names.check_optional(names.WORKER, "a/b", "name")


def test_directories_resolve_inside_the_root(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "link").symlink_to(tmp_path)
    assert names.inside_root("", str(root), "directory") == root.resolve()
    assert names.inside_root("sub", str(root), "directory") == (root / "sub").resolve()
    assert names.inside_root(str(root / "sub" / ".." / "new"), str(root), "d") == (root / "new").resolve()
    for outside in ("..", "../root2", "sub/../../x", str(tmp_path), "/etc", "link", "link/x"):
        with pytest.raises(InvalidArgument, match="outside the checkpoint root"):
            names.inside_root(outside, str(root), "path")
    with pytest.raises(InvalidArgument, match="NUL"):
        names.inside_root("a\0b", str(root), "path")
    with pytest.raises(FailedPrecondition, match="--checkpoint-dir"):
        names.inside_root(str(root), "", "directory")
