"""Torch versions of the ``torch.ops.sgl_kernel`` CPU ops SGLang's Qwen3.5 hybrid path calls.

On ``--device cpu`` SGLang binds these at import time (``srt/models/qwen3_5.py``,
``srt/layers/attention/linear/gdn_backend.py``, ``.../linear/kernels/gdn_triton.py``, and through
``sgl_kernel.mamba``'s wrappers). The real ones are C++ in ``sgl-kernel/csrc/cpu`` (``norm.cpp``,
``mamba/conv.cpp``, ``mamba/fla.cpp``, ``mamba/fused_gdn_gating.cpp``); their Python-visible
schemas are the ones registered here, and ``model_executor/cpu_graph_runner.py`` registers their
fake (shape) functions. Each op below is a plain torch function with the real op's signature,
output shapes and dtypes, and in-place effects, checked against independent references in
``test/test_sgl_kernel_stub_gdn.py``.

Layouts are SGLang 0.5.23's, the ones its own Triton kernels use on the GPU:

- recurrent (SSM) state pool ``[slots, HV, V, K]``, float32 (``Mamba2StateShape.temporal`` is
  ``(HV, head_v_dim, head_k_dim)``; the Triton decode kernel indexes ``v * K + k``);
- conv state pool ``[slots, dim, width - 1]`` (logical; read and written through indexing, so the
  AMX engine's transposed strides would work too), any float dtype (bfloat16 by default:
  ``SGLANG_MAMBA_CONV_DTYPE``); the newest ``width - 1`` inputs, oldest first;
- a negative state index (``pad_slot_id``, -1) is the pad slot: its state is neither read nor
  written (the Triton kernels' rule).

Differences from the real ops, on purpose: the real kernels dispatch bfloat16/float16 only (and
``chunk_gated_delta_rule_cpu`` bfloat16 only); these accept float32 too, the dtype the CPU harness
serves. They compute in float32 like the real kernels (float64 in, float64 math). ``is_vnni`` is
accepted and ignored: without AMX the engine never packs the conv weight, so it stays ``[dim,
width]``. Every other input the real op rejects (index dtypes, state dtype, head-dim rules) is
rejected here too.

Beyond the real ops, on purpose: speculation's target verify. 0.5.23's hybrid verify
(``gdn_backend.forward_extend`` in target-verify mode, what ``--speculative-algorithm NEXTN`` /
``EAGLE`` runs on a Qwen3.5) calls ``causal_conv1d_update_cpu`` (through ``sgl_kernel.mamba``'s
wrapper) and ``fused_sigmoid_gating_delta_rule_update_cpu`` with the arguments of upstream's Triton
kernels that keep every draft's conv window and SSM state (``VERIFY_ARGS``); the real ops of the
sgl-kernel paired with 0.5.23 take none of them (the wrapper raises ``TypeError`` on
``intermediate_conv_window``), so on a real CPU 0.5.23 cannot verify drafts of a hybrid model.
The stub's schemas add them as optional trailing arguments, with the Triton kernels' meaning
(chain and tree; ``_conv_verify``, the GDN op's docstring), so the harness can run upstream's
verify and its state commit through to the tokens. The fake (shape) functions
``cpu_graph_runner.py`` registers for torch.compile keep the real schemas: the CPU graph with
speculation is not served by the harness.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# name -> schema, as the real extension registers it (TORCH_LIBRARY_FRAGMENT(sgl_kernel, m)), with
# the in-place outputs annotated. Only these names: a stand-in for a feature probe such as
# ``convert_weight_packed`` would switch the engine onto its AMX paths.
SCHEMAS = {
    "fused_sigmoid_mul_cpu": "fused_sigmoid_mul_cpu(Tensor(a!) input, Tensor gate) -> ()",
    "fused_qk_gemma_rmsnorm_cpu": (
        "fused_qk_gemma_rmsnorm_cpu(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, "
        "int head_dim) -> (Tensor, Tensor)"
    ),
    "fused_qk_gemma_rmsnorm_with_gate_cpu": (
        "fused_qk_gemma_rmsnorm_with_gate_cpu(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, "
        "float eps, int head_dim, int num_head) -> (Tensor, Tensor, Tensor)"
    ),
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": (
        "fused_qkvzba_split_reshape_cat_contiguous_cpu(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, "
        "int num_heads_v, int head_qk, int head_v) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "fused_gdn_gating_cpu": "fused_gdn_gating_cpu(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)",
    "causal_conv1d_fwd_cpu": (
        "causal_conv1d_fwd_cpu(Tensor x, Tensor weight, Tensor? bias, Tensor(a!)? conv_states, "
        "Tensor? query_start_loc, Tensor? cache_indices, Tensor? has_initial_state, bool silu_activation, "
        "int pad_slot_id, bool is_vnni) -> Tensor"
    ),
    # + the target verify's arguments (VERIFY_ARGS): not in the real op's schema.
    "causal_conv1d_update_cpu": (
        "causal_conv1d_update_cpu(Tensor x, Tensor(a!) conv_states, Tensor weight, Tensor? bias, "
        "bool silu_activation, Tensor? cache_seqlens, Tensor? conv_state_indices, int pad_slot_id, "
        "bool is_vnni, Tensor(b!)? intermediate_conv_window=None, Tensor? intermediate_state_indices=None, "
        "Tensor? retrieve_next_token=None, Tensor? retrieve_next_sibling=None, "
        "Tensor(c!)? retrieve_parent_token=None) -> Tensor"
    ),
    "chunk_gated_delta_rule_cpu": (
        "chunk_gated_delta_rule_cpu(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta, "
        "Tensor(a!) initial_state, bool output_final_state, Tensor cu_seqlens, bool head_first, "
        "bool use_qk_l2norm_in_kernel, Tensor initial_state_indices, float eps=1e-6) -> (Tensor, Tensor)"
    ),
    # + the target verify's arguments (VERIFY_ARGS): not in the real op's schema.
    "fused_sigmoid_gating_delta_rule_update_cpu": (
        "fused_sigmoid_gating_delta_rule_update_cpu(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, "
        "Tensor v, Tensor a, Tensor b, Tensor(a!) initial_state_source, Tensor initial_state_indices, "
        "Tensor cu_seqlens, bool use_qk_l2norm_in_kernel, float softplus_beta=1.0, "
        "float softplus_threshold=20.0, bool is_kda=False, bool disable_state_update=False, "
        "Tensor(b!)? intermediate_states_buffer=None, Tensor? intermediate_state_indices=None, "
        "int? cache_steps=None, Tensor? retrieve_parent_token=None) -> Tensor"
    ),
}
# The arguments 0.5.23's hybrid target verify passes (gdn_backend.forward_extend, through
# sgl_kernel.mamba's conv wrapper and gdn_triton.TritonGDNKernel.target_verify) beyond the real
# CPU ops' schemas, with the meaning upstream's Triton kernels give them
# (kernels/ops/mamba/causal_conv1d_triton._causal_conv1d_update_kernel,
# kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py).
VERIFY_ARGS = {
    "causal_conv1d_update_cpu": (
        "intermediate_conv_window", "intermediate_state_indices", "retrieve_next_token",
        "retrieve_next_sibling", "retrieve_parent_token",
    ),
    "fused_sigmoid_gating_delta_rule_update_cpu": (
        "is_kda", "disable_state_update", "intermediate_states_buffer", "intermediate_state_indices",
        "cache_steps", "retrieve_parent_token",
    ),
}  # fmt: skip

CHUNK_SIZE = 64  # the real chunk kernel's (and FLA's) chunk length
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise RuntimeError(f"sgl_kernel stub (torch op): {what}")


def _float(t: torch.Tensor, name: str) -> None:
    _require(t.dtype in _FLOATS, f"{name} must be a float tensor, got {t.dtype}")


def _int32(t: torch.Tensor, name: str) -> None:
    _require(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")


def _acc(*ts: torch.Tensor) -> torch.dtype:
    """The compute dtype: float32, as the real kernels accumulate (float64 if given float64)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


# -- elementwise and norms (srt/models/qwen3_5.py, full-attention layers) ---------------------------
def fused_sigmoid_mul_cpu(input: torch.Tensor, gate: torch.Tensor) -> None:
    """The attention output gate, in place: ``input *= sigmoid(gate)``. ``gate`` has ``input``'s
    elements in the same order (``[T, H * D]``, or ``[T, H, D]`` against a ``[T, H * D]`` input).
    """
    _float(input, "input")
    _require(gate.dtype == input.dtype, "input and gate must have one dtype")
    _require(
        gate.numel() == input.numel() and gate.shape[0] == input.shape[0],
        "gate must match input",
    )
    acc = _acc(input)
    gated = input.to(acc) * torch.sigmoid(gate.reshape(input.shape).to(acc))
    input.copy_(gated.to(input.dtype))


def _gemma_rmsnorm_heads(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """Per head (the last dim): ``x / sqrt(mean(x^2) + eps) * (1 + weight)``, in float32."""
    acc = _acc(x)
    xf = x.to(acc)
    out = (
        xf
        * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        * (1.0 + weight.to(acc))
    )
    return out.to(x.dtype)


def _check_qk_norm(q, k, q_weight, k_weight, head_dim) -> None:
    _float(q, "q")
    _require(
        q.dim() == 2 and k.dim() == 2, "q and k are 2-D [tokens, heads * head_dim]"
    )
    _require(
        k.dtype == q.dtype and k.shape[0] == q.shape[0],
        "k must match q's tokens and dtype",
    )
    _require(k.shape[1] % head_dim == 0, "k's width must be whole heads")
    for w in (q_weight, k_weight):
        _require(
            w.shape == (head_dim,) and w.dtype == q.dtype,
            "q/k norm weights are [head_dim] in q's dtype",
        )


def fused_qk_gemma_rmsnorm_cpu(q, k, q_weight, k_weight, eps: float, head_dim: int):
    """Qwen3.5's per-head q/k GemmaRMSNorm: ``q [T, Hq * D]`` and ``k [T, Hk * D]`` normalized over
    each head of ``head_dim``; returned as new ``[T, Hq * D]`` / ``[T, Hk * D]`` tensors.
    """
    _check_qk_norm(q, k, q_weight, k_weight, head_dim)
    _require(q.shape[1] % head_dim == 0, "q's width must be whole heads")
    qn = _gemma_rmsnorm_heads(q.reshape(q.shape[0], -1, head_dim), q_weight, eps)
    kn = _gemma_rmsnorm_heads(k.reshape(k.shape[0], -1, head_dim), k_weight, eps)
    return qn.reshape(q.shape).contiguous(), kn.reshape(k.shape).contiguous()


def fused_qk_gemma_rmsnorm_with_gate_cpu(
    q_gate, k, q_weight, k_weight, eps: float, head_dim: int, num_head: int
):
    """The same norms for a gated q projection: ``q_gate [T, H * 2D]`` holds each head's query then
    its output gate (``[q_h, gate_h]``, as the checkpoint's ``q_proj`` rows are laid out). Returns
    ``q [T * H, D]`` normalized, ``k [T * Hk, D]`` normalized and ``gate [T * H, D]`` as is.
    """
    _check_qk_norm(q_gate, k, q_weight, k_weight, head_dim)
    _require(
        q_gate.shape[1] == num_head * head_dim * 2,
        "q_gate must be [tokens, num_head * head_dim * 2]",
    )
    per_head = q_gate.reshape(q_gate.shape[0], num_head, 2 * head_dim)
    q, gate = per_head[..., :head_dim], per_head[..., head_dim:]
    q_out = _gemma_rmsnorm_heads(q, q_weight, eps).reshape(-1, head_dim).contiguous()
    k_out = _gemma_rmsnorm_heads(
        k.reshape(k.shape[0], -1, head_dim), k_weight, eps
    ).reshape(-1, head_dim)
    return q_out, k_out.contiguous(), gate.reshape(-1, head_dim).contiguous()


# -- GDN input split and gates (gdn_backend.py) ------------------------------------------------------
def fused_qkvzba_split_reshape_cat_contiguous_cpu(
    mixed_qkvz, mixed_ba, num_heads_qk: int, num_heads_v: int, head_qk: int, head_v: int
):
    """Split the projections of Qwen3.5's contiguous layout, ``mixed_qkvz = [q | k | v | z]`` and
    ``mixed_ba = [b | a]`` (every block all heads, head-major), into ``mixed_qkv [T, 2 Hqk Dqk + Hv
    Dv]`` (``[q | k | v]``, the conv input), ``z [T, Hv, Dv]``, ``b [T, Hv]``, ``a [T, Hv]``.
    """
    _float(mixed_qkvz, "mixed_qkvz")
    _require(
        mixed_qkvz.dim() == 2 and mixed_ba.dim() == 2, "mixed_qkvz and mixed_ba are 2-D"
    )
    ratio = num_heads_v // max(num_heads_qk, 1)
    _require(
        num_heads_qk > 0
        and ratio * num_heads_qk == num_heads_v
        and ratio & (ratio - 1) == 0,
        "num_heads_v must be a power-of-two multiple of num_heads_qk",
    )
    qk, v = num_heads_qk * head_qk, num_heads_v * head_v
    _require(
        mixed_qkvz.shape[1] == 2 * qk + 2 * v,
        "mixed_qkvz must be [tokens, 2 Hqk Dqk + 2 Hv Dv]",
    )
    _require(
        mixed_ba.shape == (mixed_qkvz.shape[0], 2 * num_heads_v),
        "mixed_ba must be [tokens, 2 Hv]",
    )
    tokens = mixed_qkvz.shape[0]
    mixed_qkv = mixed_qkvz[:, : 2 * qk + v].contiguous()
    z = mixed_qkvz[:, 2 * qk + v :].reshape(tokens, num_heads_v, head_v).contiguous()
    b = mixed_ba[:, :num_heads_v].contiguous()
    a = mixed_ba[:, num_heads_v:].contiguous()
    return mixed_qkv, z, b, a


def _softplus(
    x: torch.Tensor, beta: float = 1.0, threshold: float = 20.0
) -> torch.Tensor:
    """``log(1 + exp(beta x)) / beta``, and ``x`` itself where ``beta x > threshold``."""
    return torch.where(beta * x > threshold, x, torch.log1p(torch.exp(beta * x)) / beta)


def fused_gdn_gating_cpu(A_log, a, b, dt_bias):
    """The GDN gates of a prefill: per token and value head, ``g = -exp(A_log) * softplus(a +
    dt_bias)`` (the log decay, float32) and ``beta = sigmoid(b)`` (in ``b``'s dtype), each
    ``[1, T, Hv]``."""
    _require(
        A_log.dim() == 1 and dt_bias.dim() == 1 and a.dim() == 2 and b.dim() == 2,
        "A_log/dt_bias 1-D, a/b 2-D",
    )
    _require(
        a.shape == b.shape and a.shape[1] == A_log.shape[0] == dt_bias.shape[0],
        "a, b, A_log, dt_bias disagree",
    )
    _float(a, "a")
    g = -torch.exp(A_log.float()) * _softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float()).to(b.dtype)
    return g.unsqueeze(0), beta.unsqueeze(0)


# -- causal conv1d (mamba/conv.cpp) -----------------------------------------------------------------
def _check_conv(x, dim: int, weight, bias, conv_states) -> int:
    _float(x, "x")
    _require(
        weight.dim() == 2 and weight.shape[0] == dim, "weight must be [dim, width]"
    )
    _require(bias is None or bias.shape == (weight.shape[0],), "bias must be [dim]")
    width = weight.shape[1]
    if conv_states is not None:
        _require(
            conv_states.dim() == 3 and conv_states.shape[1] == weight.shape[0],
            "conv_states must be [slots, dim, L]",
        )
        _require(
            conv_states.shape[2] >= width - 1, "conv_states must hold width - 1 inputs"
        )
    return width


def _conv(
    window: torch.Tensor, xs: torch.Tensor, weight, bias, silu: bool
) -> torch.Tensor:
    """Depthwise causal conv of ``xs [dim, t]`` preceded by ``window [dim, width - 1]`` (the
    previous inputs, oldest first): ``out[:, i] = sum_w weight[:, w] * cat(window, xs)[:, i + w]``.
    """
    acc = _acc(xs, weight)
    full = torch.cat([window.to(acc), xs.to(acc)], dim=1)
    out = F.conv1d(
        full.unsqueeze(0), weight.to(acc).unsqueeze(1), groups=weight.shape[0]
    ).squeeze(0)
    if bias is not None:
        out = out + bias.to(acc).unsqueeze(1)
    return F.silu(out) if silu else out


def causal_conv1d_fwd_cpu(
    x,
    weight,
    bias,
    conv_states,
    query_start_loc,
    cache_indices,
    has_initial_state,
    silu_activation: bool,
    pad_slot_id: int,
    is_vnni: bool,
):
    """The prefill conv. ``x`` is ``[dim, total_tokens]`` with sequences laid end to end at
    ``query_start_loc`` (or ``[batch, dim, seqlen]`` without it). Sequence i starts from the inputs
    in ``conv_states[cache_indices[i]]`` when ``has_initial_state[i]`` (else from zeros), and its
    slot is left holding its last ``L`` inputs (the previous ones shifted in when it is shorter).
    A sequence whose index is ``pad_slot_id`` is skipped (its output is zeros). Returns the output
    in ``x``'s shape and dtype."""
    width = _check_conv(x, x.shape[-2], weight, bias, conv_states)
    for t, name in (
        (query_start_loc, "query_start_loc"),
        (cache_indices, "cache_indices"),
    ):
        if t is not None:
            _int32(t, name)
    _require(
        has_initial_state is None or has_initial_state.dtype == torch.bool,
        "has_initial_state must be bool",
    )
    if query_start_loc is not None:
        _require(x.dim() == 2, "varlen x is [dim, total_tokens]")
        starts = query_start_loc.tolist()
        seqs = [(slice(None), slice(s, e)) for s, e in zip(starts[:-1], starts[1:])]
    else:
        _require(x.dim() == 3, "x without query_start_loc is [batch, dim, seqlen]")
        seqs = [(i, slice(None)) for i in range(x.shape[0])]
    if cache_indices is not None:
        _require(cache_indices.numel() == len(seqs), "one cache index per sequence")
    if has_initial_state is not None:
        _require(
            has_initial_state.numel() == len(seqs), "one has_initial_state per sequence"
        )
    _require(
        has_initial_state is None or conv_states is not None,
        "has_initial_state needs conv_states",
    )
    out = torch.zeros_like(x)
    dim = weight.shape[0]
    for i, (row, cols) in enumerate(seqs):
        slot = int(cache_indices[i]) if cache_indices is not None else i
        if cache_indices is not None and slot == pad_slot_id:
            continue
        xs = x[row][:, cols] if x.dim() == 3 else x[:, cols]
        initial = has_initial_state is not None and bool(has_initial_state[i])
        prev = (
            conv_states[slot]
            if initial
            else x.new_zeros(
                dim, conv_states.shape[2] if conv_states is not None else width - 1
            )
        )
        out_i = _conv(
            prev[:, prev.shape[1] - (width - 1) :], xs, weight, bias, silu_activation
        )
        if x.dim() == 3:
            out[row][:, cols] = out_i.to(x.dtype)
        else:
            out[:, cols] = out_i.to(x.dtype)
        if conv_states is not None:
            keep = conv_states.shape[2]
            conv_states[slot] = torch.cat([prev.to(xs.dtype), xs], dim=1)[:, -keep:].to(
                conv_states.dtype
            )
    return out


def causal_conv1d_update_cpu(
    x,
    conv_states,
    weight,
    bias,
    silu_activation: bool,
    cache_seqlens,
    conv_state_indices,
    pad_slot_id: int,
    is_vnni: bool,
    intermediate_conv_window=None,
    intermediate_state_indices=None,
    retrieve_next_token=None,
    retrieve_next_sibling=None,
    retrieve_parent_token=None,
):
    """The decode conv: ``x [batch, dim]`` (or ``[batch, dim, seqlen]``) continues from
    ``conv_states[conv_state_indices[b]]``, which then holds the newest inputs. A pad-slot row is
    skipped (zeros out, state untouched). The circular-buffer mode (``cache_seqlens``) is not
    implemented and raises.

    With the target verify's arguments (``VERIFY_ARGS``; ``_conv_verify``) ``x`` is ``[batch,
    dim, draft_tokens]``, the drafts of each request, convolved along their chain or tree."""
    _require(
        cache_seqlens is None,
        "cache_seqlens (circular conv state) is not implemented by the stub",
    )
    _require(x.dim() in (2, 3), "x must be [batch, dim] or [batch, dim, seqlen]")
    _check_conv(x, x.shape[1], weight, bias, conv_states)
    if conv_state_indices is not None:
        _int32(conv_state_indices, "conv_state_indices")
        _require(
            conv_state_indices.numel() == x.shape[0],
            "one conv state index per batch row",
        )
    if intermediate_conv_window is not None or retrieve_next_token is not None:
        return _conv_verify(
            x, conv_states, weight, bias, silu_activation, conv_state_indices, pad_slot_id,
            intermediate_conv_window, intermediate_state_indices, retrieve_next_token,
            retrieve_next_sibling, retrieve_parent_token,
        )  # fmt: skip
    _require(
        intermediate_state_indices is None
        and retrieve_next_sibling is None
        and retrieve_parent_token is None,
        "the verify's indices come with intermediate_conv_window / retrieve_next_token",
    )
    width = weight.shape[1]
    xs3 = x if x.dim() == 3 else x.unsqueeze(-1)
    out = torch.zeros_like(xs3)
    keep = conv_states.shape[2]
    for b in range(xs3.shape[0]):
        slot = int(conv_state_indices[b]) if conv_state_indices is not None else b
        if conv_state_indices is not None and slot == pad_slot_id:
            continue
        prev = conv_states[slot]
        out[b] = _conv(
            prev[:, keep - (width - 1) :], xs3[b], weight, bias, silu_activation
        ).to(x.dtype)
        conv_states[slot] = torch.cat([prev.to(xs3.dtype), xs3[b]], dim=1)[
            :, -keep:
        ].to(conv_states.dtype)
    return out if x.dim() == 3 else out.squeeze(-1)


def tree_parents(retrieve_next_token, retrieve_next_sibling, n: int) -> list[int]:
    """Each draft's parent (its index among the request's ``n`` drafts), as the Triton conv
    kernel derives it from EAGLE's tree lists, token by token in order: a token's first child
    (``retrieve_next_token``) gets the token as parent, its next sibling
    (``retrieve_next_sibling``) the token's own parent; ``-1`` is none. Token 0 is the root (the
    last verified token) and keeps 0, as does a token nothing points to."""
    parents = [0] * n
    for t in range(n):
        child, sibling = int(retrieve_next_token[t]), int(retrieve_next_sibling[t])
        if child != -1 and 0 <= child < n:
            parents[child] = t
        if sibling != -1 and 0 <= sibling < n:
            parents[sibling] = parents[t]
    return parents


def _conv_verify(
    x, conv_states, weight, bias, silu: bool, conv_state_indices, pad_slot_id: int, windows,
    window_indices, next_token, next_sibling, parent_out,
):  # fmt: skip
    """The target verify's conv (``_causal_conv1d_update_kernel`` with ``SAVE_INTERMEDIATE`` /
    ``HAS_EAGLE_TREE_CUSTOM_ATTN_MASK``). Request ``b``'s ``n`` drafts ``x[b] [dim, n]`` start
    from ``conv_states[conv_state_indices[b]]`` (``[dim, width - 1]``, oldest first):

    - chain (no tree lists): draft ``t`` convolves the ``width`` newest inputs up to and
      including it, the decode step's window;
    - tree (``retrieve_next_token`` / ``retrieve_next_sibling`` ``[batch, >= n]``): draft ``t``
      convolves its own input, its parent's, grand-parent's, ... (``tree_parents``), and past
      the root (draft 0) the newest inputs of the state; each request's parents are written to
      ``retrieve_parent_token[b, :n]`` (the GDN verify reads them);
    - ``windows[window_indices[b], t]`` (``[dim, width - 1]``, when given) gets the window after
      draft ``t``: the ``width - 1`` newest inputs on its path, oldest first (the state the
      accepted prefix ending at ``t`` leaves; ``scatter_mamba_states_after_mtp_verify`` copies it
      into the pool);
    - the pool slot is left holding the last ``width - 1`` drafts in ``x``'s order (the kernel's
      sliding-window write, a tree's included; the commit after verify overwrites it).

    A pad-slot row (``conv_state_indices[b] == pad_slot_id``) is skipped entirely: zeros out, no
    state, window or parent written."""
    _require(x.dim() == 3, "the verify's x is [batch, dim, draft_tokens]")
    _require(conv_state_indices is not None, "the verify needs conv_state_indices")
    batch, dim, n = x.shape
    width = weight.shape[1]
    _require(
        conv_states.shape[2] == width - 1,
        "the verify's conv_states hold exactly width - 1 inputs",
    )
    if windows is not None:
        _float(windows, "intermediate_conv_window")
        _require(
            windows.dim() == 4 and windows.shape[1] >= n and tuple(windows.shape[2:]) == (dim, width - 1),
            "intermediate_conv_window must be [rows, >= draft_tokens, dim, width - 1]",
        )  # fmt: skip
        _require(window_indices is not None, "intermediate_conv_window needs intermediate_state_indices")
        _int32(window_indices, "intermediate_state_indices")
        _require(window_indices.numel() >= batch, "one intermediate_state_index per batch row")
    tree = next_token is not None
    if tree:
        _require(
            next_sibling is not None and parent_out is not None,
            "a tree verify needs retrieve_next_sibling and retrieve_parent_token",
        )
        for t, name in ((next_token, "retrieve_next_token"), (next_sibling, "retrieve_next_sibling"),
                        (parent_out, "retrieve_parent_token")):  # fmt: skip
            _require(
                t.dim() == 2 and t.shape[0] >= batch and t.shape[1] >= n and not t.is_floating_point(),
                f"{name} must be integer [batch, >= draft_tokens]",
            )  # fmt: skip
    else:
        _require(next_sibling is None, "retrieve_next_sibling without retrieve_next_token")
    out = torch.zeros_like(x)
    for b in range(batch):
        slot = int(conv_state_indices[b])
        if slot == pad_slot_id:
            continue
        prev = conv_states[slot]  # [dim, width - 1], oldest first
        xs = x[b]
        if tree:
            parents = tree_parents(next_token[b], next_sibling[b], n)
            parent_out[b, :n] = torch.tensor(parents, dtype=parent_out.dtype)
        for t in range(n):
            if tree:  # the path back from t: t, its parent, ..., the root, then the state
                path, at = [xs[:, t]], t
                while len(path) < width and at > 0:
                    at = parents[at]
                    path.append(xs[:, at])
                path += [prev[:, -1 - i] for i in range(width - len(path))]
                window = torch.stack(path[::-1], dim=1)  # [dim, width], oldest first
            else:
                window = torch.cat([prev.to(xs.dtype), xs[:, : t + 1]], dim=1)[:, -width:]
            out[b, :, t] = _conv(
                window[:, : width - 1], window[:, width - 1 :], weight, bias, silu
            )[:, 0].to(x.dtype)
            if windows is not None:
                windows[int(window_indices[b]), t] = window[:, 1:].to(windows.dtype)
        conv_states[slot] = torch.cat([prev.to(xs.dtype), xs], dim=1)[:, -(width - 1) :].to(
            conv_states.dtype
        )
    return out


# -- gated delta rule (mamba/fla.cpp) ---------------------------------------------------------------
def _l2norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _check_state_pool(pool: torch.Tensor, hv: int, dv: int, dk: int, name: str) -> None:
    _require(pool.dtype == torch.float32, f"{name} must be float32, got {pool.dtype}")
    _require(
        pool.dim() == 4 and tuple(pool.shape[1:]) == (hv, dv, dk),
        f"{name} must be [slots, Hv, V, K]",
    )


def _chunk_sequence(q, k, v, g, beta, h, chunk_states=None):
    """One sequence of the gated delta rule, chunk by chunk (``CHUNK_SIZE`` tokens).

    q, k ``[Hv, T, K]`` (q already scaled), v ``[Hv, T, V]``, g and beta ``[Hv, T]``, h the state
    ``[Hv, K, V]`` (all in the compute dtype). Per token: ``h = exp(g) h; u = beta (v - h^T k);
    h += k u^T; o = h^T q``. Within a chunk, with ``G`` the cumulative log decay from the chunk's
    start, the updates ``u`` solve the unit lower-triangular system ``(I + A) u = beta (v -
    exp(G) K h0)``, ``A_ij = beta_i exp(G_i - G_j) k_i.k_j`` (j < i), and then ``o_i = exp(G_i) q_i
    h0 + sum_{j <= i} exp(G_i - G_j) (q_i.k_j) u_j``, ``h = exp(G_last) h0 + sum_j exp(G_last -
    G_j) k_j u_j^T``. Returns ``o [Hv, T, V]`` and the final state. ``chunk_states``, a list, gets
    the state each chunk starts from (``[Hv, K, V]``), as the Triton kernel's ``h`` holds them."""
    T = q.shape[1]
    out = torch.empty_like(v)
    for s in range(0, T, CHUNK_SIZE):
        if chunk_states is not None:
            chunk_states.append(h.clone())  # the first may be a view of the pool
        e = min(s + CHUNK_SIZE, T)
        qc, kc, vc, bc = q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e]
        G = torch.cumsum(g[:, s:e], dim=1)  # [Hv, C]
        n = e - s
        diff = G.unsqueeze(2) - G.unsqueeze(1)  # G_i - G_j
        lower = torch.ones(n, n, dtype=torch.bool).tril()
        decay = torch.where(
            lower,
            torch.exp(torch.where(lower, diff, torch.zeros_like(diff))),
            torch.zeros_like(diff),
        )
        kk = kc @ kc.transpose(1, 2)  # [Hv, C, C]
        A = (bc.unsqueeze(2) * kk * decay).tril(-1)
        eye = torch.eye(n, dtype=q.dtype).expand_as(A)
        rhs = bc.unsqueeze(2) * (vc - torch.exp(G).unsqueeze(2) * (kc @ h))
        u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        attn = (qc @ kc.transpose(1, 2)) * decay  # lower incl. diagonal
        out[:, s:e] = torch.exp(G).unsqueeze(2) * (qc @ h) + attn @ u
        g_last = G[:, -1:]  # [Hv, 1]
        h = (
            torch.exp(g_last).unsqueeze(2) * h
            + (torch.exp(g_last - G).unsqueeze(2) * kc).transpose(1, 2) @ u
        )
    return out, h


def chunk_gated_delta_rule_cpu(
    query,
    key,
    value,
    g,
    beta,
    initial_state,
    output_final_state: bool,
    cu_seqlens,
    head_first: bool,
    use_qk_l2norm_in_kernel: bool,
    initial_state_indices,
    eps: float = 1e-6,
    chunk_states: list | None = None,
):
    """The GDN prefill over packed varlen sequences: ``query``/``key`` ``[1, T, H, K]``, ``value``
    ``[1, T, Hv, V]`` (value head j reads key head ``j // (Hv / H)``), ``g`` ``[1, T, Hv]`` float32
    log decays, ``beta`` ``[1, T, Hv]``; sequence i is ``cu_seqlens[i]:cu_seqlens[i+1]`` and starts
    from ``initial_state[initial_state_indices[i]]``, where its final state is written back (the
    pool is updated in place; a negative index starts from zeros and is not written). q and k are
    L2-normalized first when ``use_qk_l2norm_in_kernel``; q is scaled by ``K ** -0.5``. Returns
    ``(o [1, T, Hv, V] in query's dtype, initial_state)``: like the real op, the second output is
    the updated pool itself. ``chunk_states`` (Python callers only, not the op's schema: the real
    op returns no per-chunk states), a list, gets each sequence's chunk-start states in order
    (``chunk_states_as_h`` turns them into the Triton kernel's ``h``)."""
    _require(not head_first, "head_first is not supported")
    _float(query, "query")
    _require(
        query.dim() == 4 and query.shape[0] == 1,
        "query must be [1, T, H, K] (packed varlen)",
    )
    _, T, H, K = query.shape
    Hv, V = value.shape[2], value.shape[3]
    _require(
        key.shape == query.shape and key.dtype == query.dtype, "key must match query"
    )
    _require(
        value.shape[:2] == (1, T) and value.dtype == query.dtype,
        "value must be [1, T, Hv, V] in query's dtype",
    )
    _require(Hv % H == 0, "value heads must be a multiple of key heads")
    _require(
        K % 32 == 0 and V % 32 == 0 and K == V,
        "head dims must be equal multiples of 32",
    )
    _require(
        g.shape == (1, T, Hv) and g.dtype == torch.float32,
        "g must be [1, T, Hv] float32",
    )
    _require(beta.shape == (1, T, Hv), "beta must be [1, T, Hv]")
    _int32(cu_seqlens, "cu_seqlens")
    _int32(initial_state_indices, "initial_state_indices")
    _require(
        cu_seqlens.numel() == initial_state_indices.numel() + 1,
        "cu_seqlens must be [num_seqs + 1]",
    )
    _check_state_pool(initial_state, Hv, V, K, "initial_state")
    acc = _acc(query)
    q, k = query[0].to(acc), key[0].to(acc)  # [T, H, K]
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q, eps), _l2norm(k, eps)
    q = q * K**-0.5
    rep = Hv // H
    q, k = (
        t.repeat_interleave(rep, dim=1).transpose(0, 1) for t in (q, k)
    )  # [Hv, T, K]
    v = value[0].to(acc).transpose(0, 1)
    gt, bt = g[0].to(acc).transpose(0, 1), beta[0].to(acc).transpose(0, 1)
    out = torch.zeros(1, T, Hv, V, dtype=query.dtype)
    bounds = cu_seqlens.tolist()
    for i, slot in enumerate(initial_state_indices.tolist()):
        s, e = bounds[i], bounds[i + 1]
        _require(0 <= s <= e <= T, "cu_seqlens out of range")
        if s == e:
            continue
        h = (
            initial_state[slot].to(acc).transpose(1, 2)
            if slot >= 0
            else q.new_zeros(Hv, K, V)
        )
        o, h = _chunk_sequence(
            q[:, s:e], k[:, s:e], v[:, s:e], gt[:, s:e], bt[:, s:e], h, chunk_states
        )
        out[0, s:e] = o.transpose(0, 1).to(query.dtype)
        if slot >= 0:
            initial_state[slot] = h.transpose(1, 2).to(initial_state.dtype)
    return out, initial_state


def chunk_states_as_h(chunk_states: list, dtype: torch.dtype) -> torch.Tensor:
    """The per-chunk states ``chunk_gated_delta_rule_cpu`` collected, laid out as the Triton/FLA
    chunk kernel returns them (``chunk_gated_delta_rule_fwd_h``'s ``h``): ``[1, NT, Hv, V, K]`` in
    the activations' dtype, NT the chunks of every sequence in batch order (``ceil(len / 64)``
    each), entry i the state chunk i starts from (a sequence's first: its initial state)."""
    return torch.stack([h.transpose(1, 2) for h in chunk_states]).unsqueeze(0).to(dtype)


def fused_sigmoid_gating_delta_rule_update_cpu(
    A_log,
    dt_bias,
    q,
    k,
    v,
    a,
    b,
    initial_state_source,
    initial_state_indices,
    cu_seqlens,
    use_qk_l2norm_in_kernel: bool,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
    is_kda: bool = False,
    disable_state_update: bool = False,
    intermediate_states_buffer=None,
    intermediate_state_indices=None,
    cache_steps=None,
    retrieve_parent_token=None,
):
    """The GDN decode step, gates fused in: ``q``/``k`` ``[1, T, H, K]``, ``v`` ``[1, T, Hv,
    V]``, ``a``/``b`` ``[T, Hv]``, sequence i the tokens ``cu_seqlens[i]:cu_seqlens[i + 1]``
    (decode: one token each). Per token: ``g = -exp(A_log) softplus(a + dt_bias)``, ``beta =
    sigmoid(b)``, then the delta rule on the state of sequence i, ``initial_state_source[
    initial_state_indices[i]]`` (``[Hv, V, K]`` float32; a negative index starts from zeros), which
    gets its final state back in place (a negative index: not written). Returns ``o [T, 1, Hv,
    V]`` (the real op's layout; the Triton kernel's ``[1, T, Hv, V]`` holds the same elements).

    The target verify (``VERIFY_ARGS``, the Triton kernel's ``fused_sigmoid_gating_delta_rule_
    update`` contract): each sequence is one request's drafts, and
    - ``disable_state_update``: the pool is read, never written;
    - ``intermediate_states_buffer`` ``[rows, >= drafts, Hv, V, K]``: row
      ``intermediate_state_indices[i]`` (skipped when negative) gets the state after each draft
      ``t`` at ``[row, t]``, in the buffer's dtype;
    - ``retrieve_parent_token`` ``[sequences, >= drafts]`` (a tree; the conv's output): draft
      ``t > 0`` continues from its parent's state read back from that row, not from draft ``t -
      1``'s (with a negative row, from draft ``t - 1``'s, as the kernel does);
    - ``cache_steps`` is the kernel's row pitch; here the buffer's own shape gives it.
    ``is_kda`` (per-key gates) is not implemented and raises."""
    _float(q, "q")
    _require(not is_kda, "is_kda (KDA's per-key gates) is not implemented by the stub")
    _require(q.dim() == 4 and v.dim() == 4, "q and v are 4-D [1, T, heads, dim]")
    one, T, H, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    _require(one == 1, "q is packed varlen: [1, T, H, K]")
    _require(k.shape == q.shape and k.dtype == q.dtype, "k must match q")
    _require(
        v.shape[:2] == (1, T) and v.dtype == q.dtype,
        "v must be [1, T, Hv, V] in q's dtype",
    )
    _require(a.shape == (T, Hv) and b.shape == (T, Hv), "a and b must be [T, Hv]")
    _require(
        a.dtype == q.dtype and b.dtype == q.dtype and dt_bias.dtype == q.dtype,
        "a, b, dt_bias in q's dtype",
    )
    _require(
        A_log.shape == (Hv,) and dt_bias.shape == (Hv,),
        "A_log and dt_bias must be [Hv]",
    )
    _require(Hv % H == 0, "value heads must be a multiple of key heads")
    _int32(initial_state_indices, "initial_state_indices")
    _int32(cu_seqlens, "cu_seqlens")
    bounds = cu_seqlens.tolist()
    N = len(bounds) - 1
    _require(
        N >= 0 and bounds[0] == 0 and bounds[-1] == T and all(s <= e for s, e in zip(bounds, bounds[1:])),
        "cu_seqlens must split the T tokens into sequences",
    )  # fmt: skip
    _require(initial_state_indices.shape == (N,), "one state index per sequence")
    _check_state_pool(initial_state_source, Hv, V, K, "initial_state_source")
    _require(
        initial_state_source.shape[0] >= N, "the state pool must hold every sequence"
    )
    steps = max((e - s for s, e in zip(bounds, bounds[1:])), default=0)
    if intermediate_states_buffer is not None:
        _require(
            intermediate_states_buffer.dim() == 5
            and intermediate_states_buffer.shape[1] >= steps
            and tuple(intermediate_states_buffer.shape[2:]) == (Hv, V, K),
            "intermediate_states_buffer must be [rows, >= tokens per sequence, Hv, V, K]",
        )
        _require(intermediate_state_indices is not None, "intermediate_states_buffer needs intermediate_state_indices")
        _int32(intermediate_state_indices, "intermediate_state_indices")
        _require(intermediate_state_indices.numel() >= N, "one intermediate_state_index per sequence")
    if retrieve_parent_token is not None:
        _require(
            retrieve_parent_token.dim() == 2
            and retrieve_parent_token.shape[0] >= N
            and retrieve_parent_token.shape[1] >= steps,
            "retrieve_parent_token must be [sequences, >= tokens per sequence]",
        )
    acc = _acc(q)
    qf, kf = q[0].to(acc), k[0].to(acc)  # [T, H, K]
    if use_qk_l2norm_in_kernel:
        qf, kf = _l2norm(qf, 1e-6), _l2norm(kf, 1e-6)
    qf = qf * K**-0.5
    rep = Hv // H
    qf, kf = qf.repeat_interleave(rep, dim=1), kf.repeat_interleave(rep, dim=1)  # [T, Hv, K]
    vf = v[0].to(acc)  # [T, Hv, V]
    g = -torch.exp(A_log.to(acc)) * _softplus(
        a.to(acc) + dt_bias.to(acc), softplus_beta, softplus_threshold
    )
    beta = torch.sigmoid(b.to(acc))  # [T, Hv]
    o = torch.empty(T, Hv, V, dtype=acc)
    for i, slot in enumerate(initial_state_indices.tolist()):
        s, e = bounds[i], bounds[i + 1]
        row = -1
        if intermediate_states_buffer is not None:
            row = int(intermediate_state_indices[i])
        h = initial_state_source[slot].to(acc) if slot >= 0 else qf.new_zeros(Hv, V, K)
        for step, t in enumerate(range(s, e)):
            if retrieve_parent_token is not None and step > 0 and row >= 0:
                parent = int(retrieve_parent_token[i, step])
                h = intermediate_states_buffer[row, parent].to(acc)
            h = h * torch.exp(g[t])[:, None, None]
            u = beta[t][:, None] * (vf[t] - (h @ kf[t].unsqueeze(-1)).squeeze(-1))  # [Hv, V]
            h = h + u.unsqueeze(-1) * kf[t].unsqueeze(-2)
            o[t] = (h @ qf[t].unsqueeze(-1)).squeeze(-1)
            if row >= 0:
                intermediate_states_buffer[row, step] = h.to(intermediate_states_buffer.dtype)
        if slot >= 0 and not disable_state_update and e > s:
            initial_state_source[slot] = h.to(initial_state_source.dtype)
    return o.unsqueeze(1).to(q.dtype)


OPS = tuple(SCHEMAS)
_LIBRARY = None


def register() -> None:
    """Define the ops under ``torch.ops.sgl_kernel`` with their CPU kernels (once per process)."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name, schema in SCHEMAS.items():
        lib.define(schema)
        lib.impl(name, globals()[name], "CPU")
    _LIBRARY = lib
