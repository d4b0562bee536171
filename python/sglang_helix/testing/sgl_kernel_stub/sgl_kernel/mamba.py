"""``sgl_kernel.mamba`` for the CPU harness: the three CPU wrappers SGLang's GDN backend imports.

They are the real wheel's Python wrappers (``sgl_kernel/mamba.py`` of the wheel paired with sglang
0.5.23), word for word in what they pass: each forwards to a ``torch.ops.sgl_kernel`` op, which the
stub defines in torch (``qwen3_5_cpu_ops``). Every other name of the module (the CUDA
``causal_conv1d_fwd`` / ``causal_conv1d_update``) is a loud ``StubKernel``. One addition:
``causal_conv1d_update_cpu`` also takes the target verify's keyword arguments, which 0.5.23 passes
and the wheel's wrapper does not accept (``qwen3_5_cpu_ops``, "Beyond the real ops").

Test-only, with ``HELIX_TEST_MAMBA_CHUNK_STATES=1`` (``sglang_helix.testing.mamba_extra_buffer``):
``chunk_gated_delta_rule_cpu`` also returns the per-chunk states ``h`` the GPU's Triton/FLA chunk
kernel returns (``[1, NT, Hv, V, K]``), which the mamba radix cache's extra buffer snapshots at
track boundaries (``hybrid_linear_attn_backend._track_mamba_state_extend``). The real wrapper
returns none (the C++ kernel computes none), so SGLang does not offer the extra buffer on the CPU;
the harness opens it only for tests that ask.
"""

import os

import torch
from sgl_kernel import StubKernel

CHUNK_STATES_ENV = "HELIX_TEST_MAMBA_CHUNK_STATES"


def causal_conv1d_fn_cpu(
    mixed_qkv_transposed,
    conv_weights,
    bias,
    activation,
    conv_states,
    has_initial_state,
    cache_indices,
    query_start_loc,
    seq_lens_cpu,
):
    return torch.ops.sgl_kernel.causal_conv1d_fwd_cpu(
        mixed_qkv_transposed,
        conv_weights,
        bias,
        conv_states,
        query_start_loc,
        cache_indices,
        has_initial_state,
        activation == "silu",
        -1,
        True,
    )


def causal_conv1d_update_cpu(
    mixed_qkv,
    conv_states,
    conv_weights,
    bias,
    activation,
    conv_state_indices,
    intermediate_conv_window=None,
    intermediate_state_indices=None,
    retrieve_next_token=None,
    retrieve_next_sibling=None,
    retrieve_parent_token=None,
):
    # The keyword arguments after conv_state_indices are not the wheel's: 0.5.23's hybrid target
    # verify passes them (gdn_backend.forward_extend), and the wheel's wrapper has no such
    # parameters (TypeError). The stub forwards them to its op (qwen3_5_cpu_ops.VERIFY_ARGS).
    return torch.ops.sgl_kernel.causal_conv1d_update_cpu(
        mixed_qkv,
        conv_states,
        conv_weights,
        bias,
        activation == "silu",
        None,
        conv_state_indices,
        -1,
        True,
        intermediate_conv_window,
        intermediate_state_indices,
        retrieve_next_token,
        retrieve_next_sibling,
        retrieve_parent_token,
    )


def chunk_gated_delta_rule_cpu(
    q,
    k,
    v,
    g,
    beta,
    initial_state,
    cu_seqlens,
    head_first,
    use_qk_l2norm_in_kernel,
    initial_state_indices,
):
    if os.environ.get(CHUNK_STATES_ENV) == "1":
        from sgl_kernel import qwen3_5_cpu_ops as ops

        states = []
        core_attn_out, last_recurrent_state = ops.chunk_gated_delta_rule_cpu(
            q,
            k,
            v,
            g,
            beta,
            initial_state,
            True,
            cu_seqlens,
            head_first,
            use_qk_l2norm_in_kernel,
            initial_state_indices,
            chunk_states=states,
        )
        return core_attn_out, last_recurrent_state, ops.chunk_states_as_h(states, q.dtype)
    core_attn_out, last_recurrent_state = (
        torch.ops.sgl_kernel.chunk_gated_delta_rule_cpu(
            q,
            k,
            v,
            g,
            beta,
            initial_state,
            True,  # output_final_state
            cu_seqlens,
            head_first,
            use_qk_l2norm_in_kernel,
            initial_state_indices,
        )
    )
    h = None  # the real wrapper does not return the per-chunk states either
    return core_attn_out, last_recurrent_state, h


WRAPPERS = (
    "causal_conv1d_fn_cpu",
    "causal_conv1d_update_cpu",
    "chunk_gated_delta_rule_cpu",
)


def __getattr__(name: str):
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    return StubKernel(f"mamba.{name}")
