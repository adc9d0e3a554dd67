"""FlashInfer's Hopper GDN decode kernels (CuTe DSL) as a `gdn_decode` backend.

One call per layer of `flashinfer.gdn_decode.gated_delta_rule_decode_pretranspose`, reading and
writing our state pool in place through `initial_state` / `initial_state_indices` (no gather or
scatter). What its source (flashinfer-python 0.7.2.post1: gdn_decode.py,
gdn_kernels/gdn_decode_pretranspose.py, gdn_decode_bf16_state.py, gdn_decode_mtp.py) does, and
how our call maps to it:

- Layout. "pretranspose" means the V-major / K-last state `[pool, HV, V, K]`, K contiguous:
  exactly our pool (`S[v, k]`, `o = S q`), passed as it is, no transpose.
- Kernels. float32 pool, q = 1: the legacy pretranspose kernel (`run_pretranspose_decode`);
  float32 pool, q > 1: `gated_delta_rule_mtp` with `disable_state_update=False` (the MTP
  kernel, gdn_decode_mtp.py); bfloat16 pool: the bf16-state kernels (`gated_delta_rule`: its
  "wide_vec" T=1 kernel when B * HV >= 512, else the ILP-4 MTP kernel; q > 1 the bf16 MTP
  kernel). We pass `backend="flashinfer"` so its "auto" never tries the source-only Cake GDN
  kernels (their sources are not in the wheel we carry).
- Shapes. Every kernel needs K = V = 128. The legacy kernel's docstring says K, V >= 128 and
  V % 8 == 0, but its 32 lanes x 4 elements cover exactly one TILE_K = 128 of K, and it fills
  its shared v / output buffers from the 128 threads only: K or V > 128 would be computed on
  the first 128 only, silently. So the capability check asks for K = V = 128
  (deltaserve.backend_checks.check_flashinfer_gdn).
- Gates and norms, inside the kernels, the same math as ours (deltaserve.ops.gdn):
  `g = -exp(A_log) * softplus(a + dt_bias)` (softplus beta 1, threshold 20: x above 20 is
  taken as is, as ours), `beta = sigmoid(b)`, q and k scaled by `rsqrt(sum(x^2) + 1e-6)`
  (`use_qk_l2norm=True`), then q by `scale` (we pass K ** -0.5, ours); the state decays by
  exp(g), takes the delta-rule update, and the output is read from the NEW state
  (`o = S_new q`), in float32 registers (fast-math exp / log / rsqrt).
- Dtypes. q, k, v are read as bfloat16 fragments (other dtypes are converted by a copy first),
  the output is written as bfloat16; A_log must be float32 (ours is a parameter in the model's
  dtype: a float32 copy is kept per parameter, `_float32`); dt_bias bfloat16 or float32; a, b
  half. The capability check asks for bfloat16 activations.
- Indices. The bf16 kernels fail to compile with int64 indices (`cache_idx` is assigned an
  Int32 for negative entries: an Int64 vs Int32 type error), the legacy kernel converts them to
  int32 itself; both widen to Int64 before multiplying the slot stride. We pass int32 (one small
  conversion per layer call), so the index dtype never refuses the backend.
- Padding rows. A negative index means padding: the bf16 kernels redirect it to slot 0 (a
  sacrificial "null" slot: read, computed, written back, output undefined); the float32 kernels
  skip the row (state untouched, output zero). Our padding rows already carry slot 0, our null
  slot (invariant 5), so we pass the slots unchanged: both paths then compute on slot 0 and the
  rows' outputs are ignored, as with our Triton kernel. (Mapping 0 to -1 would let the float32
  path skip those rows' state traffic for one more elementwise kernel per layer; not done.)
- CUDA graphs. The kernels are compiled on first use for a (shape, dtype, tile) key and then
  launched through TVM FFI on the current stream, with no host reads: capturable once compiled.
  The engine runs every graph once before capturing it (engine/cuda_graph.py), which compiles
  the tile variant of that batch size (the bf16 kernels pick tiles by batch size).
- Layouts of q / k / v / a / b: any strides with a unit last stride (they are split views of
  the fused projection); the kernels assume 16- (float32 path) or 32-byte (bf16 path) aligned
  base pointers, checked here.
"""

from __future__ import annotations

import weakref

import torch

from deltaserve.ops.gdn import GDNDecodeBackend

HEAD_DIM = 128  # the only K and V the kernels serve (see the module docstring)
ALIGN = 32  # bytes: the bf16 kernels' assumed alignment of q, k, v and the output


def _check_operand(name: str, t: torch.Tensor) -> None:
    """q, k, v as the kernels read them: bfloat16, unit last stride, 32-byte aligned base."""
    if t.dtype != torch.bfloat16:
        raise ValueError(f"flashinfer GDN decode: {name} is {t.dtype} (needs bfloat16)")
    if t.stride(-1) != 1:
        raise ValueError(f"flashinfer GDN decode: {name} needs a unit last stride, {t.stride()}")
    if t.data_ptr() % ALIGN:
        raise ValueError(
            f"flashinfer GDN decode: {name} is not {ALIGN}-byte aligned "
            f"(address % {ALIGN} = {t.data_ptr() % ALIGN})"
        )


class _Float32Params:
    """A float32 copy of each small parameter (A_log) the kernels need in float32, made once.

    Keyed by the parameter object; a copy is reused only while that object is alive and
    unmodified (`_version`). Inside a CUDA-graph capture a missing copy is made but not kept (a
    tensor made during capture holds its value only once the graph replays)."""

    def __init__(self) -> None:
        self._copies: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.float32:
            return t
        entry = self._copies.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == t._version:
            return entry[2]
        copy = t.float()
        if t.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            self._copies[id(t)] = (weakref.ref(t), t._version, copy)
        return copy


def flashinfer_gdn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_len: int = 1,
    float32_params: _Float32Params | None = None,
) -> torch.Tensor:
    """The gated delta rule over `query_len` tokens per sequence through FlashInfer, in place on
    `ssm_state` (the GDNDecodeBackend contract).

    Args:
        q, k: [N * query_len, HK, 128] bfloat16, raw (normalised inside); unit last stride.
        v: [N * query_len, HV, 128] bfloat16. a, b: [N * query_len, HV] raw gate inputs.
        A_log, dt_bias: [HV].
        ssm_state: [num_slots, HV, 128, 128] float32 or bfloat16 pool, K-last.
        state_slots: [N] pool slots (int64 or int32; slot 0: our null slot, padding rows).
        query_len: tokens per sequence (> 1: a speculative verify row, FlashInfer's MTP path).

    Returns:
        o: [N * query_len, HV, 128] bfloat16.
    """
    rows, num_k_heads, head_k_dim = q.shape
    num_v_heads, head_v_dim = v.shape[1], v.shape[2]
    n = state_slots.shape[0]
    if rows != n * query_len:
        raise ValueError(f"flashinfer GDN decode: {rows} rows != {n} sequences x {query_len}")
    if head_k_dim != HEAD_DIM or head_v_dim != HEAD_DIM:
        raise ValueError(f"flashinfer GDN decode: K={head_k_dim}, V={head_v_dim} (needs 128)")
    if ssm_state.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"flashinfer GDN decode: state dtype {ssm_state.dtype} unsupported")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_operand(name, t)
    out = torch.empty(n, query_len, num_v_heads, head_v_dim, dtype=v.dtype, device=v.device)
    if n == 0:
        return out.view(rows, num_v_heads, head_v_dim)
    # [N * q, H, D] -> [N, q, H, D]: sequence n's tokens are rows n * q .. n * q + q - 1
    q4, k4, v4 = (x.unflatten(0, (n, query_len)) for x in (q, k, v))
    a3, b3 = (x.unflatten(0, (n, query_len)) for x in (a, b))  # [N, q, HV]
    to_float32 = float32_params or _Float32Params()
    from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose

    gated_delta_rule_decode_pretranspose(
        q4,
        k4,
        v4,
        None,  # state: the pool goes in initial_state
        to_float32(A_log),
        a3,
        dt_bias,
        b3,
        scale=head_k_dim**-0.5,
        output=out,
        use_qk_l2norm=True,
        initial_state=ssm_state,
        initial_state_indices=state_slots.to(torch.int32),
        backend="flashinfer",
    )
    return out.view(rows, num_v_heads, head_v_dim)  # [N, q, HV, V] -> [N * q, HV, V]


class FlashInferGDNDecode(GDNDecodeBackend):
    """FlashInfer's CuTe DSL GDN decode (float32 or bfloat16 pool, K = V = 128), one call per
    layer, q tokens per sequence, in place on the pool, no host reads (capturable)."""

    name = "flashinfer"
    supports_cuda_graph = True

    def __init__(self) -> None:
        self._float32 = _Float32Params()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        ssm_state: torch.Tensor,
        state_slots: torch.Tensor,
        query_len: int = 1,
    ) -> torch.Tensor:
        return flashinfer_gdn_decode(
            q, k, v, a, b, A_log, dt_bias, ssm_state, state_slots, query_len, self._float32
        )
