"""kernels/mla/sdpa.py's one-query form (a decode): the branch it takes without reading q_pos on the
host must be the one the general form takes, so its bits are the general form's. The general form is
spelled out here as it was before (two host reads), and both run on the same inputs: T = 1 at S = 1
(the whole-causal branch), at S > 1 with the query last (a decode) and earlier (the contract allows
it), in fp32 and bf16, with the mutant's leak; a T > 1 call takes the general path unchanged."""
from __future__ import annotations

import pytest
import torch

from optimized_stack.kernels.mla.sdpa import sdpa_attention


def _general(q, k, v, q_pos, scale, leak=False):
    """The form before the one-query shortcut (both host reads), for the comparison."""
    t_len, s_len = q.shape[0], k.shape[0]
    vd = v.shape[-1]
    if vd < q.shape[-1]:
        v = torch.cat([v, v.new_zeros(*v.shape[:-1], q.shape[-1] - vd)], -1)
    qh, kh, vh = (x.float().permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))
    start = int(q_pos[0])
    contiguous = bool((q_pos == torch.arange(start, start + t_len)).all())
    if contiguous and start + t_len == s_len and start == 0 and not leak:
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        visible = torch.arange(s_len).view(1, -1) <= q_pos.view(-1, 1) + int(leak)
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=scale)
    return out.squeeze(0).permute(1, 0, 2)[..., :vd]


def _inputs(t, s, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    h, c, vd = 2, 24, 16
    return (torch.randn(t, h, c, generator=g).to(dtype), torch.randn(s, h, c, generator=g).to(dtype),
            torch.randn(s, h, vd, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("s,pos", [(1, 0), (2, 1), (63, 62), (200, 199), (200, 57)])
@pytest.mark.parametrize("leak", [False, True], ids=["plain", "mutant"])
def test_one_query_takes_the_general_forms_branch_and_bits(dtype, s, pos, leak):
    q, k, v = _inputs(1, s, dtype, seed=s + pos)
    q_pos = torch.tensor([pos])
    got = sdpa_attention(q, k, v, q_pos, 0.2, _mask_leaks_next=leak)
    assert torch.equal(got, _general(q, k, v, q_pos, 0.2, leak=leak))


def test_several_queries_keep_the_general_path():
    q, k, v = _inputs(5, 9, torch.float32, seed=3)
    for q_pos in (torch.arange(4, 9), torch.arange(0, 5), torch.tensor([0, 2, 4, 6, 8])):
        assert torch.equal(sdpa_attention(q, k, v, q_pos, 0.2), _general(q, k, v, q_pos, 0.2))


def test_negative_control_the_wrong_branch_gives_other_bits():
    """A shortcut that picked the whole-causal branch for a decode at S > 1 would give the query one
    key (torch's is_causal aligns the single query to key 0), not its S keys: other values, so the
    comparison above fails on a wrong branch choice. (At S = 1 both branches are right.)"""
    q, k, v = _inputs(1, 200, torch.float32, seed=8)
    qh, kh, vh = (x.float().permute(1, 0, 2).unsqueeze(0) for x in (q, k, torch.cat([v, v.new_zeros(200, 2, 8)], -1)))
    wrong = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=0.2)
    wrong = wrong.squeeze(0).permute(1, 0, 2)[..., :16]
    assert not torch.equal(sdpa_attention(q, k, v, torch.tensor([199]), 0.2), wrong)
