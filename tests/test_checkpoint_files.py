"""Weight files that are not what they claim: truncated, empty, not safetensors, or a sharded
index its shards disagree with. One line naming the file and what is wrong, exit 2 from
`info` and `serve`, and nothing on disk touched by the failed load.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from k3verify.cli import main
from optimized_stack import DEFAULT_MODEL, load_model
from optimized_stack.checkpoint import INDEX, WEIGHTS
from optimized_stack.errors import CheckpointError


@pytest.fixture
def model_dir(tmp_path) -> Path:
    out = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, out)
    return out


def _truncate_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


BREAKS = {
    "truncated-half": (_truncate_half, r"truncated: the header needs [\d,]+ bytes of tensor data, the file has "
                                       r"[\d,]+ \([\d,]+ bytes in all\)"),
    "empty": (lambda p: p.write_bytes(b""), r"expected a safetensors file, got an empty file \(0 bytes\)"),
    "text": (lambda p: p.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\n"),
             r"expected a safetensors file, got one whose first 8 bytes declare a [\d,]+-byte header but only "
             r"\d+ bytes follow \(not safetensors, or truncated inside the header\)"),
    "seven-bytes": (lambda p: p.write_bytes(b"\x01" * 7), r"expected a safetensors file \(8-byte header length "
                                                         r"first\), got 7 bytes"),
    "header-not-json": (lambda p: p.write_bytes((16).to_bytes(8, "little") + b"not json, really" + b"\0" * 64),
                        r"expected a safetensors file, got a header that is not safetensors JSON"),
}


def _snapshot(directory: Path) -> dict[str, tuple[int, int, str]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("name", BREAKS)
def test_broken_weights_file_is_one_line_naming_it(model_dir, name):
    breaker, match = BREAKS[name]
    breaker(model_dir / WEIGHTS)
    before = _snapshot(model_dir)
    with pytest.raises(CheckpointError, match=rf"^{model_dir / WEIGHTS}: {match}$") as info:
        load_model(model_dir)
    assert "\n" not in str(info.value)
    assert _snapshot(model_dir) == before, "a failed load changed the checkpoint directory"


@pytest.mark.parametrize("command", [["info"], ["serve", "--port", "0"]], ids=["info", "serve"])
@pytest.mark.parametrize("name", ["truncated-half", "empty", "text"])
def test_cli_broken_weights_exit_2(model_dir, capsys, command, name):
    """serve loads the model before it binds a port, so it fails the same way (and never listens)."""
    BREAKS[name][0](model_dir / WEIGHTS)
    code = main([*command, "--model", str(model_dir)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"k3verify: error: {model_dir / WEIGHTS}: ") and err.count("\n") == 1, err


# ---- sharded checkpoints --------------------------------------------------------------------

def _shard(model_dir: Path, edit=None) -> dict[str, list[str]]:
    """Split model.safetensors into two shards + index; edit(shards, weight_map) may change
    either before they are written. Returns shard -> names as written."""
    tensors = load_file(str(model_dir / WEIGHTS))
    (model_dir / WEIGHTS).unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {n: s for s, ns in shards.items() for n in ns}
    if edit:
        edit(shards, weight_map)
    for shard, ns in shards.items():
        save_file({n: tensors[n] for n in ns}, str(model_dir / shard))
    (model_dir / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return shards


def test_sharded_checkpoint_loads_and_matches(model_dir):
    _shard(model_dir)
    ref = load_model(DEFAULT_MODEL).state_dict()
    got = load_model(model_dir).state_dict()
    assert all((got[k] == ref[k]).all() for k in ref)


A, B = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def _move_last_to_b_in_index_only(shards, wm):          # the index says B, the tensor sits in A
    wm[shards[A][-1]] = B


def _extra_in_b(shards, wm):                              # B holds a copy of A's first tensor, unlisted there
    shards[B] = shards[B] + [shards[A][0]]


def _unlisted(shards, wm):                                # the index forgot a tensor its shard holds
    del wm[shards[B][0]]


def _missing_shard(shards, wm):
    for name in shards[B]:
        wm[name] = "model-00003-of-00002.safetensors"


def _escaping_path(shards, wm):
    for name in shards[B]:
        wm[name] = "../elsewhere.safetensors"


@pytest.mark.parametrize("edit, match", [
    (_move_last_to_b_in_index_only, rf"shard '{A}' holds tensor '[^']+', but {INDEX} lists it under '{B}'"),
    (_extra_in_b, rf"shard '{B}' holds tensor '[^']+', but {INDEX} lists it under '{A}'"),
    (_unlisted, rf"shard '{B}' holds tensor '[^']+', but {INDEX} does not list it"),
    (_missing_shard, rf"checkpoint shard 'model-00003-of-00002.safetensors' named in {INDEX} is missing"),
    (_escaping_path, rf"{INDEX}: expected shard file names inside .*, got '../elsewhere.safetensors'"),
], ids=["index-says-other-shard", "duplicate-in-two-shards", "unlisted", "missing-shard", "path-escapes"])
def test_shards_disagreeing_with_the_index_are_named(model_dir, edit, match):
    _shard(model_dir, edit)
    with pytest.raises(CheckpointError, match=match):
        load_model(model_dir)


def test_index_lists_a_tensor_its_shard_lacks(model_dir):
    def listed_not_written(shards, wm):
        wm["model.layers.0.extra.weight"] = B
    _shard(model_dir, listed_not_written)
    with pytest.raises(CheckpointError, match=rf"tensor 'model.layers.0.extra.weight' is mapped to shard '{B}' "
                                              rf"in {INDEX}, but that shard does not hold it \(1 missing\)"):
        load_model(model_dir)


def test_truncated_shard_is_named(model_dir):
    _shard(model_dir)
    _truncate_half(model_dir / B)
    with pytest.raises(CheckpointError, match=rf"^{model_dir / B}: truncated: "):
        load_model(model_dir)


@pytest.mark.parametrize("body, match", [
    ("{not json", r"expected JSON with a 'weight_map'"),
    ('{"metadata": {}}', r"expected JSON with a 'weight_map', got KeyError"),
    ('{"weight_map": ["a", "b"]}', r"expected 'weight_map' to map tensor names to shard file names, got list"),
], ids=["not-json", "no-weight-map", "list-weight-map"])
def test_bad_index_file(model_dir, body, match):
    _shard(model_dir)
    (model_dir / INDEX).write_text(body)
    with pytest.raises(CheckpointError, match=match):
        load_model(model_dir)
