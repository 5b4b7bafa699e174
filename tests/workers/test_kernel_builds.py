"""The chained round's kernels build for Hopper (sm_90, the GPU machine's H100 and H200) on a
machine without a GPU: Triton compiles each to a cubin ahead of time, so a kernel that would only
fail to compile on the GPU fails here, in CI. What they compute is tested in test_kernels.py
(under TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import pytest

from metrale.workers.models import kernels

if not kernels.available():
    pytest.skip("triton is not installed", allow_module_level=True)

import triton
from triton.compiler import ASTSource

try:
    from triton.backends.compiler import GPUTarget
except ImportError:
    pytest.skip("this Triton has no GPUTarget", allow_module_level=True)

HOPPER = GPUTarget("cuda", 90, 32)
SEQ = {"hist_ptr": "*i64", "used_ptr": "*i64", "ctx_ptr": "*i64", "stride_h": "i32"}
BUILDS = {
    "ngram_lookup": ("_ngram_lookup_kernel",
                     {"hist_ptr": "*i64", "len_ptr": "*i64", "out_ptr": "*i64", "stride_h": "i32",
                      "width": "i32", "num_drafts": "i32"},
                     {"MIN_N": 1, "MAX_N": 4, "BLOCK": 256, "D_PAD": 8, "PDL": True}),
    "round_inputs": ("_round_inputs_kernel",
                     {**SEQ, "drafts_ptr": "*i64", "tables_ptr": "*i32", "ids_ptr": "*i64",
                      "pos_ptr": "*i64", "kv_ptr": "*i64", "ctx_out_ptr": "*i32",
                      "stride_t": "i32", "length": "i32"},
                     {"PAGE": 16, "L_PAD": 8, "PDL": True}),
    "ngram_round": ("_ngram_round_kernel",
                    {**SEQ, "tables_ptr": "*i32", "ids_ptr": "*i64", "pos_ptr": "*i64",
                     "kv_ptr": "*i64", "ctx_out_ptr": "*i32", "drafts_ptr": "*i64",
                     "stride_t": "i32", "width": "i32", "length": "i32"},
                    {"MIN_N": 1, "MAX_N": 4, "BLOCK": 256, "PAGE": 16, "L_PAD": 8, "PDL": True}),
    "greedy_accept_land": ("_greedy_accept_kernel",
                           {**SEQ, "ids_ptr": "*i64", "best_ptr": "*i64", "drafts_ptr": "*i64",
                            "slots_ptr": "*i64", "offsets_ptr": "*i64", "index_ptr": "*i64",
                            "accepted_ptr": "*i64", "index_stride": "i32", "n": "i32",
                            "pad_slot": "i32", "pad_entry": "i32", "length": "i32",
                            "landing_ptr": "*i64", "stride_l": "i32"},
                           {"L_PAD": 4, "LAND": True, "ROWS_PAD": 8, "PDL": True}),
    "few_rows_tile": ("_few_rows_kernel",   # a tile of 32 rows, [gate | up] with the SiLU
                      {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
                       "count_ptr": "*i32", "m": "i32", "n_out": "i32", "n_in": "i32",
                       "stride_x": "i32", "k_len": "i32"},
                      {"M_PAD": 32, "BLOCK_N": 32, "BLOCK_K": 256, "SPLITS": 1, "SILU_MUL": True,
                       "IEEE": False, "PDL": True}),
    "round_advance": ("_round_advance_kernel",
                      {**SEQ, "best_ptr": "*i64", "accepted_ptr": "*i64", "landing_ptr": "*i64",
                       "stride_l": "i32", "length": "i32"},
                      {"L_PAD": 8, "PDL": True}),
}


def _build(name: str, signature: dict, constants: dict):
    fn = getattr(kernels, name)
    # every argument named: a pointer or integer in `signature`, else a constexpr in `constants`
    signature = {a: signature.get(a, "constexpr") for a in fn.arg_names}
    assert all(t != "constexpr" or a in constants for a, t in signature.items())
    try:
        return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                              target=HOPPER)
    except RuntimeError as e:   # no CUDA toolchain in this Triton (ptxas): nothing to check
        if "ptxas" in str(e).lower():
            pytest.skip(f"this Triton cannot build for CUDA here: {e}")
        raise


@pytest.mark.parametrize("kernel", sorted(BUILDS))
@pytest.mark.parametrize("pdl", [True, False])
def test_the_chain_kernels_build_for_hopper(kernel, pdl):
    """With programmatic dependent launch (Hopper's) and without (the interpreter's path)."""
    name, signature, constants = BUILDS[kernel]
    compiled = _build(name, signature, {**constants, "PDL": pdl})
    assert compiled.asm.get("cubin")
