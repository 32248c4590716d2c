"""k3verify CLI: dispatch, exit codes (0 ok / 1 failed / 2 bad input), one-line errors, info and generate."""

import json
import subprocess
import sys
import textwrap

import pytest

from k3verify import cli, commands
from k3verify.commands import info as info_cmd

PRESET = "k3-mini"


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _json(out: str) -> dict:
    """--json: stdout is one JSON document, whole (tables go to stderr)."""
    return json.loads(out)


# ---- dispatcher (no model needed) ---------------------------------------

def test_help_lists_commands(capsys):
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    assert "info" in out and "generate" in out


def test_version(capsys):
    code, out, _ = _run(capsys, "--version")
    assert code == 0 and out.startswith("k3verify ")


def test_unknown_command_suggests(capsys):
    code, out, err = _run(capsys, "inf")
    assert code == 2
    assert err.strip().startswith("k3verify: error: unknown command 'inf'; did you mean 'info'")


def test_unknown_command_without_close_match_lists_choices(capsys):
    code, _, err = _run(capsys, "zzzzzz")
    assert code == 2
    assert "did you mean" not in err and "choose from" in err and "info" in err


def test_missing_command_is_usage_error(capsys):
    code, _, err = _run(capsys)
    assert code == 2 and "a command is required" in err


def test_argparse_error_exits_2(capsys):
    code, _, err = _run(capsys, "generate", "--max-tokens", "many", "--prompt", "x")
    assert code == 2 and "invalid int value" in err


def test_bad_flag_value_is_one_line(capsys):
    code, out, err = _run(capsys, "generate", "--prompt", "x", "--max-tokens", "0")
    assert code == 2
    assert err == "k3verify: error: --max-tokens must be >= 1, got 0\n"


def test_script_exits_with_code():
    # `python -m k3verify.cli` goes through the same sys.exit(main()) as the console script.
    proc = subprocess.run([sys.executable, "-m", "k3verify.cli", "genrate"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "did you mean 'generate'" in proc.stderr


@pytest.fixture
def fake_commands(tmp_path, monkeypatch):
    """Point command discovery at a scratch package directory; returns a writer for modules."""
    monkeypatch.setattr(commands, "__path__", [str(tmp_path)])
    written = []

    def write(name, body):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
        written.append(f"k3verify.commands.{name}")

    yield write
    for mod in written:
        sys.modules.pop(mod, None)


FAKE = """
    from optimized_stack.errors import K3Error
    from k3verify.errors import CheckFailed
    NAME = "fake"
    HELP = "a fake command"
    def add_arguments(p):
        p.add_argument("--mode", default="ok")
    def run(args):
        if args.mode == "ok":
            return 0
        if args.mode == "fail":
            return 1
        if args.mode == "k3":
            raise K3Error("config field 'x': expected 1,\\ngot 2")
        if args.mode == "checkfailed":
            raise CheckFailed("logits differ at step 3")
        if args.mode == "missing":
            open("/nonexistent/k3verify-test-file")
        if args.mode == "bug":
            raise RuntimeError("a real bug")
        return 7
"""


@pytest.mark.parametrize(
    "mode,code,err",
    [
        ("ok", 0, ""),
        ("fail", 1, ""),
        ("k3", 2, "k3verify: error: config field 'x': expected 1, got 2\n"),
        ("checkfailed", 1, "k3verify: check failed: logits differ at step 3\n"),
        ("missing", 2, "k3verify: error: file not found: /nonexistent/k3verify-test-file\n"),
    ],
    ids=["ok", "check-failed-return", "k3error-one-line", "checkfailed-raise", "file-not-found"],
)
def test_exit_codes(fake_commands, capsys, mode, code, err):
    fake_commands("fake", FAKE)
    got, _, got_err = _run(capsys, "fake", "--mode", mode)
    assert (got, got_err) == (code, err)


def test_real_bugs_are_not_swallowed(fake_commands, capsys):
    # Negative control for the handlers above: only bad input maps to 2; a bug keeps its traceback.
    fake_commands("fake", FAKE)
    with pytest.raises(RuntimeError, match="a real bug"):
        cli.main(["fake", "--mode", "bug"])


def test_bad_return_code_is_a_bug(fake_commands):
    fake_commands("fake", FAKE)
    with pytest.raises(TypeError, match="must return 0, 1 or 2, got 7"):
        cli.main(["fake", "--mode", "other"])


def test_discovery_skips_private_and_rejects_incomplete(fake_commands):
    fake_commands("_helper", "X = 1\n")
    fake_commands("fake", FAKE)
    assert list(cli.discover_commands()) == ["fake"]
    fake_commands("half", 'NAME = "half"\n')
    with pytest.raises(TypeError, match="missing HELP, add_arguments, run"):
        cli.discover_commands()


def test_discovery_rejects_duplicate_names(fake_commands):
    fake_commands("fake", FAKE)
    fake_commands("fake2", FAKE)
    with pytest.raises(TypeError, match="command name 'fake' defined twice"):
        cli.discover_commands()


# ---- parameter counting (no model needed) -------------------------------

def test_count_parameters_by_name():
    import types

    import torch

    m = torch.nn.Module()
    m.embed = torch.nn.Parameter(torch.zeros(10, 4))
    m.layers = torch.nn.Module()
    m.layers.mlp = torch.nn.Module()
    m.layers.mlp.experts = torch.nn.Parameter(torch.zeros(4, 3, 2))
    m.layers.mlp.shared_experts = torch.nn.Parameter(torch.zeros(5, 2))
    m.layers.mlp.routed_expert_down_proj = torch.nn.Parameter(torch.zeros(2, 4))
    m.config = types.SimpleNamespace(num_experts=4, num_experts_per_token=1)
    got = info_cmd.count_parameters(m)
    assert got == {"total": 40 + 24 + 10 + 8, "routed_experts": 24, "active_per_token": 40 + 10 + 8 + 6}


# ---- info / generate on the k3-mini preset -------------------------------

@pytest.fixture(scope="module")
def mini():
    optimized_stack = pytest.importorskip("optimized_stack")
    if not hasattr(optimized_stack, "load_model"):
        pytest.skip("optimized_stack.load_model has not landed yet")
    return optimized_stack.load_model(PRESET)


def _expected_routed(cfg) -> int:
    """Independent of parameter names: each routed expert is w1, w3 [I, D'] and w2 [D', I]."""
    width = cfg.routed_expert_hidden_size or cfg.hidden_size
    moe_layers = cfg.num_layers - cfg.first_k_dense_replace
    return moe_layers * cfg.num_experts * 3 * width * cfg.moe_intermediate_size


def test_info_preset(mini, capsys):
    code, out, err = _run(capsys, "info", "--model", PRESET, "--json")
    assert code == 0, err
    data = _json(out)
    cfg = mini.config
    letters = "".join("K" if k == "kda" else "M" for k in cfg.layer_kinds)
    assert data["layer_map"].replace(" ", "") == letters
    assert data["layer_map"] in err, "the table (on stderr under --json) shows the layer map too"
    total = sum(p.numel() for p in mini.parameters())
    routed = _expected_routed(cfg)
    assert data["params"]["total"] == total
    assert data["params"]["routed_experts"] == routed, "expert params found by name must match the config's shape"
    assert data["params"]["active_per_token"] == total - routed + routed * cfg.num_experts_per_token // cfg.num_experts
    assert data["params"]["active_per_token"] < total, "top_k < num_experts must leave some experts inactive"
    assert data["source"]["kind"] == "preset" and data["source"]["sha256"] is None


def test_info_kimi_style_layer_map(mini):
    assert mini.config.layer_map().split(" ")[0] == "KKKM", "k3-mini: MLA at 1-indexed layer 4"


def test_info_directory_sha256(mini, tmp_path, capsys):
    import hashlib

    from optimized_stack.checkpoint import save_checkpoint

    save_checkpoint(mini, tmp_path)
    code, out, err = _run(capsys, "info", "--model", str(tmp_path), "--json")
    assert code == 0, err
    data = _json(out)
    assert data["source"]["kind"] == "directory"
    assert data["source"]["sha256"] == hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest()
    assert data["source"]["sha256"] in err, "the hash is in the table (stderr under --json), not only the JSON"
    assert data["params"]["total"] == sum(p.numel() for p in mini.parameters())


@pytest.mark.parametrize("model", ["/nonexistent/k3verify-model-dir", "k3-nosuch-preset"], ids=["missing-path", "unknown-preset"])
def test_bad_model_is_one_line_exit_2(mini, capsys, model):
    code, _, err = _run(capsys, "info", "--model", model)
    assert code == 2
    assert err.startswith("k3verify: error: ") and err.count("\n") == 1, err


def test_generate_preset(mini, capsys):
    code, out, err = _run(capsys, "generate", "--model", PRESET, "--prompt", "Hello", "--max-tokens", "4", "--json")
    assert code == 0, err
    data = _json(out)
    assert 1 <= len(data["token_ids"]) <= 4
    assert data["stop"] in ("eos", "max_tokens")
    assert "tokens/s" in err, "the human summary goes to stderr under --json"


def test_generate_matches_whole_sequence_forward(mini, capsys):
    # Greedy tokens from the incremental path must be the argmax of a fresh whole-sequence forward.
    import torch

    from optimized_stack.tokenizer import ByteTokenizer

    code, out, _ = _run(capsys, "generate", "--model", PRESET, "--prompt", "Hi", "--max-tokens", "3", "--chat", "--json")
    assert code == 0
    data = _json(out)
    ids = ByteTokenizer().apply_chat_template([{"role": "user", "content": "Hi"}]) + data["token_ids"]
    with torch.inference_mode():
        logits = mini.forward(torch.tensor(ids), mini.new_state())
    n = len(data["token_ids"])
    prompt_len = len(ids) - n
    assert logits[prompt_len - 1 : prompt_len - 1 + n].argmax(-1).tolist() == data["token_ids"]
