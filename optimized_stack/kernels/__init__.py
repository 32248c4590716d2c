"""Fast paths behind toggles: one folder per op, every form of it side by side.

    kda/       chunked.py  (chunked UT form, CPU; single-sequence op form + batched training form)
               recurrent.py (batched recurrence: the differentiable CPU fallback of training)
               fla.py      (fla-core's chunk / fused-recurrent kernels: op forms + training form)
    mla/       absorbed.py (attention over latent rows), sdpa.py (torch's fused SDPA: op + training),
               fp8_prefill.py (prefill attention on FP8 Q/K/V)
    moe/       grouped.py  (expert GEMMs over tokens grouped by expert), side_stream.py,
               fp8_stage2.py (expert outputs stored in FP8 before the combine)
    fp8_rows.py  e4m3 with one scale per row: the storage form the FP8 forms share
    attn_res/  the seeded faults of the AttnRes read

The reference of every op stays in optimized_stack/model/ (plain, one obvious way); each
form here has the reference's signature, so a toggle swaps an op-table slot
(model/ops.py OpTable) and nothing else. Every folder's toggle_defs.py registers its
toggles and mutants; optimized_stack.toggles discovers those modules, no list to edit.
"""
