"""One way to switch an op: a toggle names op-table slots, applied in one place, always
restored; no class is patched; slot names are checked; toggle modules are discovered."""
from __future__ import annotations

import pytest

from optimized_stack import toggles as registry
from optimized_stack.errors import K3Error
from optimized_stack.model import attn_res, kda, mla, model, moe, ops

CLASSES = (moe.MoE, moe.Router, moe.GLU, attn_res.AttnResRead, mla.MLAttention, kda.KDAttention,
           model.K3Model, model.DecoderLayer)


def _snapshot():
    return {cls: dict(vars(cls)) for cls in CLASSES}, {f: getattr(ops.OPS, f) for f in ops.OpTable.__dataclass_fields__}


@pytest.mark.parametrize("name", [t.name for t in registry.all_toggles()])
def test_applying_a_toggle_changes_op_slots_only_and_restores_them(name):
    classes, slots = _snapshot()
    toggle = registry.get(name)
    with registry.applied([name]) as applied:
        now_classes, now_slots = _snapshot()
        assert now_classes == classes, f"{name} changed a class attribute: only op-table slots may change"
        changed = {k for k in slots if now_slots[k] is not slots[k]}
        want = {k for t in applied.toggles for k in t.ops}
        assert changed == want, f"{name}: slots changed {sorted(changed)}, declared {sorted(want)}"
        for k in toggle.ops:
            # the slot holds its implementation wrapped by the call counter (op:<slot> path event)
            assert now_slots[k].__wrapped__ is toggle.ops[k]
    assert _snapshot() == (classes, slots), f"{name} left the op table changed"


def test_an_unknown_slot_is_refused_with_a_suggestion():
    with pytest.raises(K3Error, match=r"unknown op slot 'kda_prefil'; did you mean 'kda_prefill'\?"):
        registry.Toggle(name="tmp_bad_slot", description="x", contract=registry.EXACT, touches=("logits",),
                        ops={"kda_prefil": lambda *a: None})


def test_two_toggles_that_want_one_slot_differently_are_refused():
    a = registry.Toggle(name="tmp_slot_a", description="x", contract=registry.EXACT, touches=("logits",),
                        ops={"linear": ops.plain_linear})
    b = registry.Toggle(name="tmp_slot_b", description="x", contract=registry.EXACT, touches=("logits",),
                        ops={"linear": ops.row_linear})
    registry.register(a)
    registry.register(b)
    try:
        with pytest.raises(K3Error, match="toggles disagree on op slot 'linear'"):
            with registry.applied(["tmp_slot_a", "tmp_slot_b"]):
                pass
        assert ops.OPS.linear is ops.row_linear
    finally:
        registry._REGISTRY.pop("tmp_slot_a")
        registry._REGISTRY.pop("tmp_slot_b")


def test_every_toggle_defs_file_is_a_discovered_module():
    """A toggle_defs.py in a folder without __init__.py would be silently skipped by the package
    walk: every such file on disk must be a discovered module."""
    from pathlib import Path

    import optimized_stack
    root = Path(optimized_stack.__file__).parent
    on_disk = {"optimized_stack." + ".".join(p.relative_to(root).with_suffix("").parts)
               for p in root.rglob("*toggle_defs.py")}
    assert on_disk and on_disk == set(registry.toggle_modules()), on_disk ^ set(registry.toggle_modules())


def test_toggle_modules_are_discovered_and_every_toggle_comes_from_one():
    mods = registry.toggle_modules()
    assert "optimized_stack.kernels.kda.toggle_defs" in mods and "optimized_stack.engine.toggle_defs" in mods
    assert all(m.rsplit(".", 1)[-1].endswith("toggle_defs") for m in mods)
    import sys
    for t in registry.all_toggles():
        if t.ops:
            owner = next(iter(t.ops.values()))
            fn = getattr(owner, "func", owner)
            assert fn.__module__.startswith("optimized_stack."), t.name
    assert all(m in sys.modules for m in mods)


def test_decode_and_prefill_are_separate_slots():
    """A one-token call takes the decode slot, a longer one the prefill slot."""
    seen = []

    def spy(tag):
        def fn(q, k, v, g, beta, state):
            seen.append((tag, q.shape[0]))
            return kda.kda_recurrent(q, k, v, g, beta, state)
        return fn

    from optimized_stack import load_model
    import torch
    m = load_model("k3-mini")
    with ops.override(kda_prefill=spy("prefill"), kda_decode=spy("decode")):
        st = m.new_state()
        m.forward(torch.arange(5), st)
        m.forward(torch.tensor([7]), st)
    layers = len(m.config.kda_layers)
    assert seen == [("prefill", 5)] * layers + [("decode", 1)] * layers
