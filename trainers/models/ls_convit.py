""" ConViT (GPSA) for locality-search, with an exact fast gated positional self-attention

Paper:
* `ConViT: Improving Vision Transformers with Soft Convolutional Inductive Biases`
  - https://arxiv.org/abs/2103.10697

@article{d2021convit,
  title={ConViT: Improving Vision Transformers with Soft Convolutional Inductive Biases},
  author={d'Ascoli, St{\'e}phane and Touvron, Hugo and Leavitt, Matthew and Morcos, Ari and Biroli, Giulio and Sagun, Levent},
  journal={arXiv preprint arXiv:2103.10697},
  year={2021}
}

Structure, parameter names and initialisation follow timm's `timm/models/convit.py`, so a state dict
moves between `LocalityConViT` and timm's `ConVit` unchanged (same keys, same shapes). What differs:

* `embed_dim` is the TOTAL width here (the search space sees the real width); timm's ConViT takes
  it per head and multiplies by `num_heads`. `ls_convit_tiny` (embed_dim=192, 4 heads) is timm's
  `convit_tiny` (embed_dim=48, 4 heads).
* GPSA is computed without materialising the B x H x N x N mixed attention. Per head h,
      A = (1 - s) * softmax(Q K^T / sqrt(d)) + s * softmax(pos),  s = sigmoid(gating_param[h]),
      pos[i, j] = v_pos . r_ij,  r_ij = (dx, dy, dx^2 + dy^2)  (key patch minus query patch).
  `pos` does not depend on the input, so P = softmax(pos) (H x N x N) is computed once per forward
  and shared by the whole batch:
      A @ V = (1 - s) * scaled_dot_product_attention(Q, K, V) + s * (P @ V).
  The paper (and timm) divide A by its row sums afterwards; both terms are already row-stochastic
  and 0 <= s <= 1, so the row sums are exactly 1 and that renormalisation is a no-op (dropped).
  Attention dropout acts on A itself, which the fast path never forms: with `attn_drop > 0` a
  GPSA layer in training mode falls back to the explicit formula (same result as timm). The
  model does not expose attention dropout, so model forwards always take the fast path.
* Where it runs (all exact, same numbers up to rounding; `benchmarks/gpsa_layer.py` times them):
  - the q, k and v projections are one matmul (the `qk` and `v` weights concatenated per call in
    training, once for inference like P; the parameters and state-dict keys stay timm's);
  - on the CPU (training and inference): `gated_attention` (`_attention_core`, shared with the
    plain `MHSA` blocks), one autograd function for the attention core. Forward: S = Q K^T /
    sqrt(d) (one batched GEMM), softmax, the mixed A = (1 - s) softmax(S) + s P (one pass, P
    broadcast over the batch), A @ V. Backward by hand from the saved softmax and A: dV = A^T dO,
    dA = dO V^T, dS = (1 - s) / sqrt(d) * softmax'(dA), dQ = dS K, dK = dS^T Q; the gate's and
    P's gradients from sum_b dA (skipped when frozen).
    On a 2-core CPU this beats fused SDPA plus a separate P @ V: the maps are small (N <= 196)
    and the GEMMs batched. Without autograd the same core runs in place on one buffer, and (fp32/64,
    no autocast) q, k and v come out of one batched matmul already head-major, so the layout copy
    between the projection and the core is gone;
  - in float32 on the CPU where the float32 kernel is built (no autocast; up to C 192), the whole
    layer, the projections with the core, as one op per direction over a few images at a time
    (`_gpsa_layer`: their data stays in cache between the products);
  - under CPU autocast (bf16/fp16; the trainer's `precision: bf16`) the q/k/v and output
    projections run in bf16 as autocast decides; in the core the softmax, the mixing with P and
    the maps' gradients stay float32 (as autocast keeps softmax), and the batched GEMMs run in
    bf16 on a CPU with bf16 hardware (AVX512-BF16 or AMX, `cpu_has_native_bf16`: there they are
    several times quicker than in float32) and in float32 elsewhere (q, k, v cast up in the pass
    that lays them out, the output cast back in the pass that lays it out for the projection;
    emulated bf16 GEMMs are the slower ones). Either way no map is rounded twice, as timm's ConViT
    under the same autocast does (scores rounded to bf16, then scaled in bf16);
  - otherwise (CUDA): fused `scaled_dot_product_attention` for the content term and one GEMM per
    head, P @ V, for the whole batch; for fp16/bf16 inference (autocast, as a trial evaluates)
    with a head width of one or two powers of two >= 16 (ConViT-Ti's 48 = 32 + 16), one Triton
    kernel (`_gpsa_triton`) computes both terms and the mix, reading q, k and v straight from the
    projection's output (`USE_FUSED_CUDA_KERNEL = False` turns it off);
  - P itself (softmax of v_pos . r_ij, tiny) is computed in the parameters' dtype even under
    autocast: no bf16 rounding of scores that lie hundreds of units apart, and no casts.
* Knobs the search needs: `gate_init` (initial gating parameter; paper 1.0) and `gate_lr_mult`
  (learning-rate multiplier for the gating parameters, applied through `param_groups()`).
* With `local_up_to_layer == depth` (every layer GPSA) no self-attention layer is left to read the
  patches into a class token (timm then classifies the first *patch* token); here the model has
  no class token and average-pools the patch tokens instead.
* `drop_rate` is the dropout of the original ConViT/DeiT code: after the position embedding, on
  the attention projection output and in the MLP (timm's `drop_rate` is the classifier dropout).
"""
import contextlib
import math
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from timm.layers import LayerNorm, PatchEmbed, calculate_drop_path_rates, trunc_normal_
from timm.models import generate_default_cfgs, register_model
from timm.models._features_fx import register_notrace_module

from trainers.models import _attention_kernel, _gpsa_layer, _gpsa_triton
from trainers.models._attention_core import (CPU_CORE_DTYPES, FULL_PRECISION, attention_inference, compiled_away,
                                             gated_attention)
from trainers.models._common import (
    MHSA, GridSize, PreNormBlock, _build_without_weights, _cfg, _check_int, _check_real, _check_vit_args,
    _fashion_mnist_cfg, _gated_param_groups, _init_vit_weights, _patch_tokens,
)
from trainers.models._kept import parameters_key
from trainers.models._linear import Linear, linear

__all__ = ['GPSA', 'MHSA', 'Block', 'LocalityConViT', 'gated_attention']


def rel_indices(grid_size: GridSize) -> torch.Tensor:
    """Relative positions r_ij = (dx, dy, dx^2 + dy^2) of key j minus query i, shape (N, N, 3).

    Patches are numbered row-major (n = row * W + col), x is the column and y the row: for a
    square grid this is exactly timm's `GPSA.get_rel_indices` (without its leading batch dim).
    """
    h, w = grid_size
    rows = torch.arange(h, dtype=torch.float32).repeat_interleave(w)  # (N,) row of patch n
    cols = torch.arange(w, dtype=torch.float32).repeat(h)  # (N,) column of patch n
    dx = cols[None, :] - cols[:, None]  # (N, N): [query, key]
    dy = rows[None, :] - rows[:, None]
    return torch.stack((dx, dy, dx ** 2 + dy ** 2), dim=-1)


_NEGLIGIBLE = 1e-30


def _softmax_without_denormals(scores: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim, with the entries below 1e-30 set to 0.

    A local positional attention on a large grid (14 x 14 at 224 px) puts most keys hundreds of
    units below the peak, so a plain softmax fills P with subnormal floats, and every op that
    reads P (the mixing, over the whole batch) then runs several times slower on x86. Rows sum to
    1, so those entries are below 1e-30 of the row: zeroing them changes no output or gradient
    beyond float32 rounding (nor float64 at the tolerances of tests/test_convit.py), and what is
    left, times any gate above 1e-8, stays a normal float.
    """
    P = scores.softmax(dim=-1)
    return P.masked_fill(P < _NEGLIGIBLE, 0.)


def _square_grid(num_patches: int) -> GridSize:
    side = math.isqrt(num_patches)
    if side * side != num_patches:
        raise ValueError(
            f'GPSA got {num_patches} tokens, which is not a square patch grid; pass grid_size=(rows, cols) '
            'to GPSA, or feed it patch tokens only (no class token)')
    return side, side


# CUDA inference in fp16/bf16 runs GPSA's core as one Triton kernel (`_gpsa_triton`); False keeps
# fused SDPA + P @ V there too (the benchmarks time both side by side).
USE_FUSED_CUDA_KERNEL = True


@register_notrace_module  # reason: the rel_indices cache is Python control flow
class GPSA(nn.Module):
    """Gated positional self-attention; `dim` is the total width (as in timm's GPSA).

    Parameters (names as timm): qk (dim -> 2 dim), v, proj, pos_proj (3 -> H), gating_param (H,).
    """

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            qkv_bias: bool = False,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            locality_strength: float = 1.,
            gate_init: float = 1.,
            grid_size: Optional[GridSize] = None,
    ):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'GPSA: dim={dim} is not divisible by num_heads={num_heads}; pick a multiple')
        self.num_heads = num_heads
        self.dim = dim
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.locality_strength = locality_strength
        self.gate_init = gate_init
        self.attn_drop_p = float(attn_drop)
        self.grid_size = tuple(grid_size) if grid_size is not None else None

        self.qk = Linear(dim, dim * 2, bias=qkv_bias)
        self.v = Linear(dim, dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = Linear(dim, dim)
        self.pos_proj = nn.Linear(3, num_heads)
        self.proj_drop = nn.Dropout(proj_drop)
        self.gating_param = nn.Parameter(torch.full((num_heads,), float(gate_init)))

        # r_ij for the last grid seen, (N, N, 3); non-persistent: rebuilt, never saved.
        self._rel_grid: Optional[GridSize] = None
        self.register_buffer('rel_indices', torch.zeros(0, 0, 3), persistent=False)
        # name -> (key, tensor): what inference reuses until the parameters change (see _frozen)
        self._frozen_cache: Dict[str, Tuple[tuple, Any]] = {}
        if self.grid_size is not None:
            self._set_rel_indices(self.grid_size)
        # standalone, initialise as LocalityConViT does (the model re-applies the same scheme)
        for linear in (self.qk, self.v, self.proj, self.pos_proj):
            trunc_normal_(linear.weight, std=.02)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.local_init()

    # --- relative positions ------------------------------------------------------------------
    def _set_rel_indices(self, grid: GridSize) -> None:
        w = self.qk.weight
        with torch.inference_mode(False):  # a normal tensor even when first built during inference
            self.rel_indices = rel_indices(grid).to(device=w.device, dtype=w.dtype)
        self._rel_grid = grid

    def _grid_for(self, num_patches: int) -> GridSize:
        if self.grid_size is not None and self.grid_size[0] * self.grid_size[1] == num_patches:
            return self.grid_size
        return _square_grid(num_patches)

    def init_non_persistent_buffers(self) -> None:
        """Recompute the cached relative positions (e.g. after materialising from the meta device)."""
        if self._rel_grid is not None:
            self._set_rel_indices(self._rel_grid)

    # --- attention maps ----------------------------------------------------------------------
    def _frozen(self, name: str, params: Tuple[torch.Tensor, ...], extra: tuple, compute: Callable[[], Any]) -> Any:
        """compute(), which depends only on `params` and `extra`; without autograd (inference) it is
        kept and reused until a parameter may have changed (`_kept.parameters_key`: an optimizer
        step, load_state_dict, a move or a cast) or `extra` does. With autograd it is
        recomputed (part of the graph) and the kept copy dropped. Kept values are normal tensors,
        not inference tensors. Under torch.compile it is traced into the graph (a Python-side cache
        keyed on storage would only cause recompiles)."""
        if torch.compiler.is_compiling():
            return compute()
        if torch.is_grad_enabled():
            self._frozen_cache.pop(name, None)
            return compute()
        key = (extra, torch.is_inference_mode_enabled(), parameters_key(*params))
        kept = self._frozen_cache.get(name)
        if kept is not None and kept[0] == key:
            return kept[1]
        # normal tensors even when built during inference: _linear keeps the oneDNN layout of a
        # weight (the qkv one) only where a version counter tracks it (see _linear._packed_weight)
        with torch.inference_mode(False), torch.no_grad():
            value = compute()
        self._frozen_cache[name] = (key, value)
        return value

    def positional_attention(self, grid: GridSize) -> torch.Tensor:
        """P = softmax(v_pos . r_ij) over keys j, (H, N, N); independent of the input, so kept
        for inference (see `_frozen`)."""
        if self._rel_grid != grid or self.rel_indices.device != self.qk.weight.device:
            self._set_rel_indices(grid)
        return self._frozen('pos', (self.pos_proj.weight, self.pos_proj.bias), grid,
                            lambda: self._positional_attention(grid))

    def _positional_attention(self, grid: GridSize) -> torch.Tensor:
        N = grid[0] * grid[1]
        weight = self.pos_proj.weight
        rel = self.rel_indices.to(weight.dtype).view(N * N, 3)
        # in the parameters' dtype even under autocast: none of the casts autocast would add (8
        # per layer and training step; a model this small trains host-bound on a GPU), and the
        # scores, up to hundreds of units apart on a 14 x 14 grid, are not rounded to bf16
        device_type = weight.device.type
        # (no autocast on the meta device, say; torch 2.11's dynamo cannot trace the availability
        # check: it broke the graph in every GPSA layer, and compiled ConViT-Ti ran 0.69x eager on an H200)
        with (torch.autocast(device_type, enabled=False)
              if torch.compiler.is_compiling() or torch.amp.is_autocast_available(device_type)
              else contextlib.nullcontext()):
            # v_pos . r_ij + bias as (H, 3) @ (3, N*N): the scores come out head-major and contiguous
            pos = torch.addmm(self.pos_proj.bias.view(-1, 1), weight, rel.t()).view(-1, N, N)
            if pos.device.type != 'cpu':  # subnormals slow down only x86 (see the helper)
                return pos.softmax(dim=-1)  # (H, N, N)
            return _softmax_without_denormals(pos)

    def get_attention_map(self, x: torch.Tensor) -> torch.Tensor:
        """The full mixed attention A (B, H, N, N) by the explicit formula (no dropout).

        Unlike timm's `get_attention_map` (batch-averaged distances), this returns A itself; every
        row sums to 1. Materialises B x H x N x N: for analysis and tests, not for training.
        """
        B, N, C = x.shape
        q, k = self.qk(x).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        content = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)  # (B, H, N, N)
        gate = torch.sigmoid(self.gating_param).view(-1, 1, 1)  # (H, 1, 1)
        return (1. - gate) * content + gate * self.positional_attention(self._grid_for(N))

    # --- forward -----------------------------------------------------------------------------
    def _qkv_weight(self) -> torch.Tensor:
        """q, k and v's weight (3C, C): rows [q | k | v] as timm's qk then v."""
        weights = (self.qk.weight, self.v.weight)
        return self._frozen('qkv_weight', weights, (), lambda: torch.cat(weights))

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        """q, k and v in one matmul: (B, N, 3 * C), columns [q | k | v] as timm's qk then v."""
        weight = self._qkv_weight()
        bias = None
        if self.qk.bias is not None:
            biases = (self.qk.bias, self.v.bias)
            bias = self._frozen('qkv_bias', biases, (), lambda: torch.cat(biases))
        return linear(x, weight, bias)

    def _qkv_heads_first(self, x: torch.Tensor) -> torch.Tensor:
        """`_qkv` for inference, laid out (3, H, B, N, d) contiguous: one batched matmul of the
        tokens with each head's q, k and v weights (3H x C x d, kept like P), which costs what the
        (B*N x C) @ (C x 3C) matmul does and saves the copy from (B, N, 3, H, d) to head-major."""
        B, N, C = x.shape
        H, d = self.num_heads, self.head_dim
        weights = (self.qk.weight, self.v.weight)
        per_head = self._frozen('qkv_heads', weights, (),
                                lambda: torch.cat(weights).view(3 * H, d, C).transpose(1, 2).contiguous())
        tokens = x.reshape(1, B * N, C).expand(3 * H, B * N, C)  # the same tokens for every head
        if self.qk.bias is None:
            qkv = torch.bmm(tokens, per_head)
        else:
            biases = (self.qk.bias, self.v.bias)
            bias = self._frozen('qkv_heads_bias', biases, (), lambda: torch.cat(biases).view(3 * H, 1, d))
            qkv = torch.baddbmm(bias, tokens, per_head)
        return qkv.view(3, H, B, N, d)

    def _use_gated_attention(self, x: torch.Tensor) -> bool:
        """The explicit core (`gated_attention`): on the CPU, for training and inference alike, in
        float32/64 and in bfloat16/float16 (CPU autocast, or a model cast to that dtype); see the
        module doc. Elsewhere (CUDA), and under torch.compile (`compiled_away`), fused SDPA + P @ V."""
        return x.device.type == 'cpu' and x.dtype in CPU_CORE_DTYPES and not compiled_away()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        H, d = self.num_heads, self.head_dim
        if self.training and self.attn_drop_p > 0.:
            # explicit path: dropout must act on the mixed attention A
            v = self.v(x).reshape(B, N, H, d)  # (B, N, H, d)
            attn = self.attn_drop(self.get_attention_map(x))  # (B, H, N, N)
            out = (attn @ v.transpose(1, 2)).transpose(1, 2)  # (B, N, H, d)
            return self.proj_drop(self.proj(out.reshape(B, N, C)))

        if self._use_gated_attention(x):
            gate = torch.sigmoid(self.gating_param)  # (H,)
            pos_attn = self.positional_attention(self._grid_for(N))  # P (H, N, N)
            if _gpsa_layer.usable(self, x):  # float32: the projections and the core as one op
                return _gpsa_layer.gpsa_layer(x, self._qkv_weight(), gate, pos_attn, self.proj.weight, self.proj.bias,
                                              self.scale)
            if (not torch.is_grad_enabled() and x.dtype in FULL_PRECISION and not torch.is_autocast_enabled('cpu')
                    and not _attention_kernel.available(x.dtype, N)):
                # inference on torch ops: q, k, v come out of their matmul already laid out for
                # them (the fused kernel reads the projection's layout as it is)
                out = attention_inference(self._qkv_heads_first(x), self.scale, gate, pos_attn.to(x.dtype))
                out = out.permute(1, 2, 0, 3)  # (H, B, N, d) -> (B, N, H, d)
            else:
                qkv = self._qkv(x).view(B, N, 3, H, d).permute(2, 0, 3, 1, 4)  # (3, B, H, N, d) view
                out = gated_attention(qkv, gate, pos_attn, self.scale).transpose(1, 2)  # (B, N, H, d)
            return self.proj_drop(self.proj(out.reshape(B, N, C)))

        qkv = self._qkv(x).view(B, N, 3, H, d)
        if (USE_FUSED_CUDA_KERNEL and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and _gpsa_triton.available(qkv, d)):
            # inference: both terms and the mix in one Triton kernel, written (B, N, H, d); under
            # torch.compile the SDPA path below, which inductor fuses around
            pos_attn, content_weight = self._mixing_terms(self._grid_for(N), qkv.dtype)
            out = _gpsa_triton.gated_attention_inference(qkv, pos_attn, content_weight, self.scale)
            return self.proj_drop(self.proj(out.view(B, N, C)))
        q, k, v = qkv.unbind(2)  # (B, N, H, d) each
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, N, d)
        # content term, fused: (B, H, N, d), scaled by (1 - s) afterwards
        content = F.scaled_dot_product_attention(q, k, v.transpose(1, 2))
        pos_attn, content_weight = self._mixing_terms(self._grid_for(N), v.dtype)  # s * P (H, N, N), 1 - s (H, 1)
        # positional term: one GEMM per head for the whole batch, (H, N, N) @ (H, N, B*d)
        pos_out = torch.bmm(pos_attn, v.permute(2, 1, 0, 3).reshape(H, N, B * d))  # (H, N, B*d)
        pos_out = pos_out.view(H, N, B, d).permute(2, 1, 0, 3)  # (B, N, H, d)
        if torch.is_grad_enabled() or torch.compiler.is_compiling():  # (an out= op has no backward;
            # under torch.compile, functionalised, out= would keep pos_out's head-major layout)
            out = torch.addcmul(pos_out, content.transpose(1, 2), content_weight)  # (B, N, H, d), v's dtype
        else:  # written (B, N, H, d)-contiguous, so the reshape below is a view, not a copy (left to
            # itself, addcmul lays its output out as pos_out, head-major)
            out = torch.addcmul(pos_out, content.transpose(1, 2), content_weight,
                                out=torch.empty((B, N, H, d), dtype=pos_out.dtype, device=x.device))
        return self.proj_drop(self.proj(out.reshape(B, N, C)))

    def _mixing_terms(self, grid: GridSize, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """(s * P (H, N, N), 1 - s (H, 1)) in `dtype` (the values' dtype: bf16 under autocast, so the
        mix stays in it), s = sigmoid(gate); input-independent, so kept for inference (see `_frozen`):
        a GPU then launches two kernels fewer per layer and batch."""
        def compute() -> Tuple[torch.Tensor, torch.Tensor]:
            gate = torch.sigmoid(self.gating_param)  # (H,)
            pos_attn = gate.view(-1, 1, 1) * self.positional_attention(grid)
            return pos_attn.to(dtype), (1. - gate).view(-1, 1).to(dtype)

        # one kept pair per dtype: a model evaluated in bf16 and timed in fp32 in turn (or benchmarked
        # so) would otherwise recompute them at every switch
        return self._frozen(f'mixing_{dtype}', (self.pos_proj.weight, self.pos_proj.bias, self.gating_param), grid,
                            compute)

    @torch.no_grad()
    def local_init(self) -> None:
        """Convolutional init (timm's): W_val = I; the first floor(sqrt(H))^2 heads centred on their
        offset of a sqrt(H) x sqrt(H) kernel; all of v_pos scaled by the locality strength."""
        self.v.weight.copy_(torch.eye(self.dim))
        kernel_size = math.isqrt(self.num_heads)
        center = (kernel_size - 1) / 2 if kernel_size % 2 == 0 else kernel_size // 2
        for h1 in range(kernel_size):
            for h2 in range(kernel_size):
                position = h1 + kernel_size * h2
                self.pos_proj.weight[position, 2] = -1
                self.pos_proj.weight[position, 1] = 2 * (h1 - center)  # dy centre
                self.pos_proj.weight[position, 0] = 2 * (h2 - center)  # dx centre
        self.pos_proj.weight.mul_(self.locality_strength)
        self.gating_param.fill_(self.gate_init)


class Block(PreNormBlock):
    """A ConViT block: GPSA (`use_gpsa`) or plain multi-head self-attention."""

    def __init__(
            self,
            dim: int,
            num_heads: int,
            mlp_ratio: float = 4.,
            qkv_bias: bool = False,
            proj_drop: float = 0.,
            drop_path: float = 0.,
            use_gpsa: bool = True,
            locality_strength: float = 1.,
            gate_init: float = 1.,
            grid_size: Optional[GridSize] = None,
    ):
        if use_gpsa:
            attn = GPSA(dim, num_heads=num_heads, qkv_bias=qkv_bias, proj_drop=proj_drop,
                        locality_strength=locality_strength, gate_init=gate_init, grid_size=grid_size)
        else:
            attn = MHSA(dim, num_heads=num_heads, qkv_bias=qkv_bias, proj_drop=proj_drop)
        super().__init__(dim, attn, mlp_ratio=mlp_ratio, proj_drop=proj_drop, drop_path=drop_path)
        self.use_gpsa = use_gpsa


class LocalityConViT(nn.Module):
    """ConViT: `local_up_to_layer` GPSA blocks, then the class token, then plain MHSA blocks.

    `embed_dim` is the total width (timm's ConVit: per head). `local_up_to_layer=0` is a DeiT.
    """
    family = 'convit'

    def __init__(
            self,
            *,
            img_size: Union[int, Tuple[int, int]] = 224,
            patch_size: int = 16,
            in_chans: int = 3,
            num_classes: int = 1000,
            embed_dim: int = 768,
            depth: int = 12,
            num_heads: int = 16,
            mlp_ratio: float = 4.,
            qkv_bias: bool = False,
            drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            local_up_to_layer: int = 10,
            locality_strength: float = 1.,
            gate_init: float = 1.,
            gate_lr_mult: float = 1.,
            use_pos_embed: bool = True,
    ):
        super().__init__()
        img_hw = _check_vit_args(
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, num_classes=num_classes, embed_dim=embed_dim,
            depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, drop_rate=drop_rate,
            drop_path_rate=drop_path_rate, use_pos_embed=use_pos_embed, width_hint=' (timm ConViT takes it per head)')
        _check_int('local_up_to_layer', local_up_to_layer, 0)
        _check_real('locality_strength', locality_strength, 0.)
        _check_real('gate_init', gate_init, -math.inf)
        _check_real('gate_lr_mult', gate_lr_mult, 0.)
        if local_up_to_layer > depth:
            raise ValueError(
                f'local_up_to_layer={local_up_to_layer} exceeds depth={depth}; it counts GPSA layers, '
                f'use a value in [0, {depth}] (0 = DeiT)')

        self.num_classes = num_classes
        self.in_chans = in_chans
        self.local_up_to_layer = local_up_to_layer
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.locality_strength = locality_strength
        self.gate_init = gate_init
        self.gate_lr_mult = gate_lr_mult
        self.use_pos_embed = use_pos_embed

        self.patch_embed = PatchEmbed(img_size=img_hw, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim)
        self.grid_size: GridSize = tuple(self.patch_embed.grid_size)
        self.num_patches = num_patches = self.patch_embed.num_patches

        # the class token joins after the last GPSA layer; with no SA layer after it, there is none
        if local_up_to_layer < depth:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
            self.num_prefix_tokens = 1
            self.global_pool = 'token'
        else:
            self.cls_token = None
            self.num_prefix_tokens = 0
            self.global_pool = 'avg'
        self.pos_drop = nn.Dropout(p=drop_rate)
        if use_pos_embed:
            self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, embed_dim))
            trunc_normal_(self.pos_embed, std=.02)
        else:
            self.pos_embed = None

        dpr = calculate_drop_path_rates(drop_path_rate, depth)  # stochastic depth decay rule
        self.blocks = nn.ModuleList([
            Block(
                dim=embed_dim,
                num_heads=num_heads,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                proj_drop=drop_rate,
                drop_path=dpr[i],
                use_gpsa=i < local_up_to_layer,
                locality_strength=locality_strength,
                gate_init=gate_init,
                grid_size=self.grid_size,
            ) for i in range(depth)])
        self.norm = LayerNorm(embed_dim)
        self.feature_info = [dict(num_chs=embed_dim, reduction=patch_size, module=f'blocks.{i}') for i in range(depth)]
        self.head = Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

        if self.cls_token is not None:
            trunc_normal_(self.cls_token, std=.02)
        self.apply(_init_vit_weights)
        for m in self.modules():
            if isinstance(m, GPSA):
                m.local_init()

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {'pos_embed', 'cls_token'}

    def param_groups(self, weight_decay: float) -> List[Dict[str, Any]]:
        """AdamW parameter groups, each {'params', 'weight_decay', 'lr_scale'} (lr = base lr * lr_scale).

        Gating parameters: lr_scale = gate_lr_mult, no weight decay. Biases, norms, pos_embed and
        cls_token: no weight decay. Everything else: `weight_decay`. Frozen parameters are left out;
        empty groups are dropped.
        """
        return _gated_param_groups(self, weight_decay, gate_lr_mult=self.gate_lr_mult,
                                   no_decay_names=self.no_weight_decay())

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(
            stem=r'^cls_token|pos_embed|patch_embed',  # stem and embed
            blocks=[(r'^blocks\.(\d+)', None), (r'^norm', (99999,))]
        )

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        if global_pool is not None:
            if global_pool not in ('token', 'avg') or (global_pool == 'token' and self.cls_token is None):
                raise ValueError(f"global_pool={global_pool!r}: use 'avg'"
                                 + ('' if self.cls_token is None else " or 'token'"))
            self.global_pool = global_pool
        self.num_classes = num_classes
        w = self.norm.weight
        self.head = (Linear(self.embed_dim, num_classes, device=w.device, dtype=w.dtype)
                     if num_classes > 0 else nn.Identity())

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = _patch_tokens(self.patch_embed, x)  # (B, N, C)
        if self.pos_embed is not None:
            x = x + self.pos_embed
        x = self.pos_drop(x)
        for i, blk in enumerate(self.blocks):
            if i == self.local_up_to_layer and self.cls_token is not None:
                x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)  # (B, N + 1, C)
            x = blk(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x[:, 0] if self.global_pool == 'token' else x[:, self.num_prefix_tokens:].mean(dim=1)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _create_ls_convit(variant: str, pretrained: bool = False, **kwargs) -> LocalityConViT:
    hint = ' (timm convit_* weights load directly, the keys are the same)'
    return _build_without_weights(LocalityConViT, variant, pretrained, weights_hint=hint, **kwargs)


default_cfgs = generate_default_cfgs({
    'ls_convit_nano': _fashion_mnist_cfg(),
    'ls_convit_micro': _fashion_mnist_cfg(),
    'ls_convit_tiny': _cfg(),
    'ls_convit_small': _cfg(),
    'ls_convit_base': _cfg(),
})


@register_model
def ls_convit_nano(pretrained: bool = False, **kwargs) -> LocalityConViT:
    """Test-sized: 28x28 grayscale, 7x7 patches of 4, width 32, 4 heads, 1 GPSA + 1 SA layer."""
    model_args = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=32, depth=2,
                      num_heads=4, local_up_to_layer=1, locality_strength=1.0)
    return _create_ls_convit('ls_convit_nano', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ls_convit_micro(pretrained: bool = False, **kwargs) -> LocalityConViT:
    """CPU default for Fashion-MNIST: 28x28 grayscale, 7x7 patches of 4, width 96, 4 heads, 3 GPSA + 5 SA.

    Sized for a 2-core CPU: fwd + bwd + AdamW step at batch 128 takes about 0.3 s (about 12 s for
    5000 images), 0.9 M parameters.
    """
    model_args = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=96, depth=8,
                      num_heads=4, local_up_to_layer=3, locality_strength=1.0)
    return _create_ls_convit('ls_convit_micro', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ls_convit_tiny(pretrained: bool = False, **kwargs) -> LocalityConViT:
    """timm convit_tiny (ConViT-Ti): width 192, 4 heads, 10 GPSA + 2 SA."""
    model_args = dict(embed_dim=192, depth=12, num_heads=4, local_up_to_layer=10, locality_strength=1.0)
    return _create_ls_convit('ls_convit_tiny', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ls_convit_small(pretrained: bool = False, **kwargs) -> LocalityConViT:
    """timm convit_small (ConViT-S): width 432, 9 heads, 10 GPSA + 2 SA."""
    model_args = dict(embed_dim=432, depth=12, num_heads=9, local_up_to_layer=10, locality_strength=1.0)
    return _create_ls_convit('ls_convit_small', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ls_convit_base(pretrained: bool = False, **kwargs) -> LocalityConViT:
    """timm convit_base (ConViT-B): width 768, 16 heads, 10 GPSA + 2 SA."""
    model_args = dict(embed_dim=768, depth=12, num_heads=16, local_up_to_layer=10, locality_strength=1.0)
    return _create_ls_convit('ls_convit_base', pretrained=pretrained, **dict(model_args, **kwargs))
