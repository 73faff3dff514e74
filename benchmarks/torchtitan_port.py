"""torchtitan's Kimi K3 port (pytorch/torchtitan pull request 4025) as a peer of ours: build it, run it, load our
weights into it and its weights into ours. Importing this module does nothing; ``import_port()`` puts the tree that
``benchmarks/setup_torchtitan.sh`` extracts on ``sys.path`` and applies the shims torch 2.11 needs.

Legend: T = tokens, B = sequences, V = vocabulary.

What the port is (facts from its ``models/kimi_k3``; see shared/reference/k3-released-layout.md):
- the text model takes one document per call: 1-D tokens [T], positions ``arange(T)``, and the attention masks
  from ``model.get_attention_masks(positions)`` (a FlexAttention BlockMask for its MLA layers); its KDA rejects
  packed-document masks and carries conv and recurrent state across any boundary, so sequences cannot be packed
  into one call. ``port_train_loss`` runs a [B, T] batch as B calls.
- no MTP module: its loss is the main next-token cross-entropy only (ours adds ``mtp.loss_weight`` x MTP CE).
- the routed experts run in bf16 (grouped matmuls) whatever the model dtype; ``fp32_experts`` swaps in an fp32
  grouped matmul for an exact-precision parity run.
- its expert bias is a persistent fp32 buffer updated only by torchtitan's optimizer hook, which is not installed
  here: the bias stays what was loaded (zeros for a fresh model) while it trains.
- MLA goes through ``torch.compile(flex_attention)`` with max-autotune and coordinate-descent tuning (minutes of
  warm-up); ``import_port(compile_mode="fast")`` recompiles it with the default inductor options.

A peer training step (one GPU, bf16 parameters as ours trains, fused AdamW):
    port = build_port("cuda", torch.bfloat16, init_on_device=True)   # train mode
    load_ours_into_port(port, our_model)     # optional: same starting weights, comparable losses
    import_port(compile_mode="fast")         # before the first forward; "autotune" is the port's own (minutes)
    opt = torch.optim.AdamW(port.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    loss = port_train_loss(port, ids[:, :-1], ids[:, 1:], backward=True)   # B forwards + backwards, one row each
    opt.step(); opt.zero_grad(set_to_none=True)
``backward=True`` is gradient accumulation over the rows, as torchtitan trains this model (one sequence per
micro-batch); compare its loss with our ``main_loss`` (ours also spends an MTP layer and a second head per token:
set ``mtp.num_modules=0`` in our config for equal work).

Shims (torch 2.11 lacks what the port's nightly target has):
- ``torch.distributed.fsdp.DataParallelMeshDims``: a placeholder dataclass when missing (only FSDP code uses it);
- ``create_block_mask(..., separate_full_blocks=)``: the keyword is dropped when torch's function has no such
  parameter (2.11 always separates full blocks, which is what the port asks for outside batch-invariant mode);
- the multimodal data module the model imports (for one isinstance check) is replaced by a placeholder: it pulls in
  grain, datasets, torchvision and PIL, none of which the model needs (stubbing grain alone does not suffice);
- inductor options unknown to the installed torch are left out of FlexAttention's compile.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "third_party" / "torchtitan"
PINNED_COMMIT = "dee45e35721d24b8ab959a93140d0f799734eed1"
IGNORE_INDEX = -100

_PORT: types.SimpleNamespace | None = None


# ---------------------------------------------------------------------------------------------------- import + shims
_MM_DATASETS = "torchtitan.hf_datasets.multimodal.mm_datasets"


class _DataPlaceholder:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{_MM_DATASETS} is stubbed (benchmarks/torchtitan_port.py): no data pipeline here")


def _stub_mm_datasets() -> bool:
    """The model's one import from the data pipeline is ``MMSamplePackingConfig`` of the multimodal datasets
    module, for an isinstance check in ``update_from_config`` (which only a Trainer calls); that module imports
    grain, datasets, torchvision and PIL. A module holding a placeholder class stands in for it."""
    if _MM_DATASETS in sys.modules:
        return False
    module = types.ModuleType(_MM_DATASETS)
    module.MMSamplePackingConfig = type("MMSamplePackingConfig", (_DataPlaceholder,), {"__module__": _MM_DATASETS})
    sys.modules[_MM_DATASETS] = module
    return True


def _install_fsdp_placeholder() -> None:
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        @dataclasses.dataclass
        class DataParallelMeshDims:
            """Placeholder (torch < 2.12 has none): the port's FSDP code names it; nothing here shards."""
            shard: Any = None
            replicate: Any = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims


def _known_inductor_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options the installed inductor knows (torch.compile raises on an unknown one at the first call)."""
    import torch._inductor.config as inductor_config

    known = {}
    for key, value in options.items():
        holder = inductor_config
        *parents, leaf = key.split(".")
        try:
            for part in parents:
                holder = getattr(holder, part)
            getattr(holder, leaf)
        except AttributeError:
            continue
        known[key] = value
    return known


def _patch_block_mask(attention_mod: types.ModuleType, decoder_mod: types.ModuleType) -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    if "separate_full_blocks" in inspect.signature(create_block_mask).parameters:
        return
    original = attention_mod.create_attention_mask

    def create_attention_mask(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("separate_full_blocks", None)
        return original(*args, **kwargs)

    attention_mod.create_attention_mask = create_attention_mask
    decoder_mod.create_attention_mask = create_attention_mask   # the decoder imported the name itself


def set_flex_compile(mode: str = "fast") -> None:
    """Recompile the port's FlexAttention: ``"fast"`` with inductor's defaults (seconds of warm-up), ``"autotune"``
    with the port's own options (max-autotune + coordinate descent, minutes), ``"eager"`` none: the block mask
    evaluated densely and SDPA (CPU checks: differentiable where flex_attention's CPU path is not; short
    sequences)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    port = import_port()
    flex, attention = port.FlexAttention, port.attention_module
    if not hasattr(flex, "_port_inductor_configs"):
        flex._port_inductor_configs = dict(flex.inductor_configs)
        attention._port_compiled_create_block_mask = attention._compiled_create_block_mask
    attention._compiled_create_block_mask = (create_block_mask if mode == "eager"
                                             else attention._port_compiled_create_block_mask)
    if mode == "eager":
        flex._compiled_flex_attn = _dense_flex_attention
        return
    if mode == "fast":
        options = {key: value for key, value in flex._port_inductor_configs.items()
                   if key not in ("max_autotune", "coordinate_descent_tuning")}
    elif mode == "autotune":
        options = dict(flex._port_inductor_configs)
    else:
        raise ValueError(f"compile mode must be fast, autotune or eager, got {mode!r}")
    options = _known_inductor_options(options)
    flex.inductor_configs = options
    flex._compiled_flex_attn = torch.compile(flex_attention, options=options)


def _dense_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, score_mod: Any = None,
                          block_mask: Any = None, scale: float | None = None, enable_gqa: bool = False,
                          return_aux: Any = None, kernel_options: Any = None) -> tuple[torch.Tensor, Any]:
    """flex_attention's call as the port makes it (no score_mod, no lse), as SDPA with the dense boolean mask."""
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    if score_mod is not None or (return_aux is not None and (return_aux.lse or return_aux.max_scores)):
        raise NotImplementedError("the dense stand-in for flex_attention takes no score_mod and returns no lse")
    mask = None
    if block_mask is not None:
        mask = create_mask(block_mask.mask_mod, 1, 1, q.shape[-2], k.shape[-2], device=q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, AuxOutput()


def import_port(*, compile_mode: str | None = None) -> types.SimpleNamespace:
    """Import the port (once) with the shims applied. Returns a namespace: ``model_registry``, ``KimiK3Model``,
    ``FlexAttention``, ``attention_module``, ``KimiGroupedExperts``, ``TokenChoiceTopKRouter``, ``commit`` (of the
    extracted tree; a warning when it is not the pinned one), ``mm_datasets_stubbed``. ``compile_mode``: see
    ``set_flex_compile`` (None keeps what was set; the port's own autotuned compile at first)."""
    global _PORT
    if _PORT is None:
        if not (TREE / "torchtitan" / "models" / "kimi_k3" / "model.py").is_file():
            raise RuntimeError(f"torchtitan's Kimi K3 port is not at {TREE}: run benchmarks/setup_torchtitan.sh "
                               "(and carry third_party/ and .whl/ to the GPU machine)")
        loaded = sys.modules.get("torchtitan")
        if loaded is not None and not str(getattr(loaded, "__file__", "")).startswith(str(TREE)):
            raise RuntimeError(f"another torchtitan is already imported ({loaded.__file__})")
        if str(TREE) not in sys.path:
            sys.path.insert(0, str(TREE))
        _install_fsdp_placeholder()
        stubbed = _stub_mm_datasets()
        try:
            attention = importlib.import_module("torchtitan.models.common.attention")
            decoder = importlib.import_module("torchtitan.models.common.decoder")
            kimi = importlib.import_module("torchtitan.models.kimi_k3")
        except ImportError as exc:
            raise ImportError(f"importing torchtitan's Kimi K3 port failed ({exc}); its wheels are in .whl/ "
                              "(benchmarks/setup_torchtitan.sh): pip install --no-index --no-deps .whl/*.whl") from exc
        _patch_block_mask(attention, decoder)
        moe = importlib.import_module("torchtitan.models.kimi_k3.moe")
        common_moe = importlib.import_module("torchtitan.models.common.moe")
        commit_file = TREE / "COMMIT"
        commit = commit_file.read_text().strip() if commit_file.is_file() else "unknown"
        if commit != PINNED_COMMIT:
            warnings.warn(f"torchtitan tree at {TREE} is {commit}, not the pinned {PINNED_COMMIT}", stacklevel=2)
        _PORT = types.SimpleNamespace(
            model_registry=kimi.model_registry, KimiK3Model=kimi.KimiK3Model, FlexAttention=attention.FlexAttention,
            attention_module=attention,
            KimiGroupedExperts=moe.KimiGroupedExperts, TokenChoiceTopKRouter=common_moe.TokenChoiceTopKRouter,
            commit=commit, mm_datasets_stubbed=stubbed)
        set_flex_compile("autotune")   # the port's options, less those the installed inductor does not know
    if compile_mode is not None:
        set_flex_compile(compile_mode)
    return _PORT


# ---------------------------------------------------------------------------------------------------- build + run
def port_config(flavor: str = "debugmodel", our_config: Any = None) -> Any:
    """The port's text-model config (no vision encoder): its registry ``flavor``, or, given ``our_config`` (a
    ``K3Config``), the same topology assembled by the port's own config builder (for small CPU checks). Raises
    ValueError for what the port cannot express (MLA and KDA head counts differ, a shared expert's hidden width
    differs from a routed one's, a KDA gate rank other than the head width, more than one dense layer, no AttnRes,
    tied embeddings)."""
    port = import_port()
    if our_config is None:
        return dataclasses.replace(port.model_registry(flavor).model, vision_encoder=None)
    c = our_config
    problems = [text for bad, text in (
        (c.kda.num_heads != c.mla.num_heads, "kda.num_heads != mla.num_heads"),
        ((c.moe.shared_hidden or c.moe.expert_hidden) != c.moe.expert_hidden, "moe.shared_hidden != expert_hidden"),
        (c.kda_gate_rank != c.kda_head_dim, "kda.gate_rank != kda head_dim"),
        (c.dense_layers != 1, "dense_layers != 1"),
        (not c.attn_res.enabled, "attn_res disabled"),
        (c.tie_embeddings, "tied embeddings"),
        (c.moe.route_scale != 1.0 or c.kda.g_min != -5.0 or c.kda.norm_eps != 1e-5 or c.norm_eps != 1e-5,
         "route_scale / g_min / eps other than the released values")) if bad]
    if problems:
        raise ValueError("the port's config builder cannot express this config: " + "; ".join(problems))
    builder = importlib.import_module("torchtitan.models.kimi_k3")._kimi_k3_config
    return builder(
        dim=c.dim, vocab_size=c.vocab_size, num_layers=c.num_layers, full_attention_layers=set(c.mla_layer_indices),
        attn_res_block_size=c.attn_res.block_size, num_heads=c.mla.num_heads, q_lora_rank=c.mla.q_lora_rank,
        kv_lora_rank=c.mla.kv_lora_rank, qk_nope_head_dim=c.mla.qk_nope_head_dim,
        qk_rope_head_dim=c.mla.qk_rope_head_dim, v_head_dim=c.mla.v_head_dim, kda_head_dim=c.kda_head_dim,
        conv_kernel_size=c.kda.conv_kernel, dense_hidden_dim=c.dense_hidden, latent_dim=c.moe.latent_dim,
        expert_hidden_dim=c.moe.expert_hidden, num_experts=c.moe.num_experts, top_k=c.moe.top_k,
        num_shared_experts=c.moe.num_shared_experts, vision_encoder=None, attn_backend="flex")


def build_port(device: torch.device | str, dtype: torch.dtype, seed: int = 0, *, flavor: str = "debugmodel",
               our_config: Any = None, fp32_experts: bool = False, init_on_device: bool = False) -> torch.nn.Module:
    """The port's text model (no vision encoder), built as its numerical test does: on meta, ``to_empty`` on the
    CPU, cast to ``dtype``, ``init_states`` (seeded; the RNG states are left as they were), then moved to
    ``device``. ``init_on_device``: materialise and initialise on ``device`` itself (faster on a GPU; other
    values for the same seed). ``device="meta"`` stops after building (keys and shapes only). ``flavor`` /
    ``our_config``: see ``port_config``. Returned in train mode; call ``.eval()`` for inference.
    ``fp32_experts``: see ``use_fp32_experts``."""
    config = port_config(flavor, our_config)
    with torch.device("meta"):
        model = config.build()
    device = torch.device(device)
    if device.type != "meta":
        init_device = device if init_on_device else torch.device("cpu")
        model.to_empty(device=init_device)
        model.to(dtype=dtype)
        with torch.random.fork_rng(devices=[init_device] if init_device.type == "cuda" else []):
            torch.manual_seed(seed)
            model.init_states(buffer_device=init_device)
        model.to(device)
    if fp32_experts:
        use_fp32_experts(model)
    return model


def cast_port(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast a built port to ``dtype`` the way ``build_port`` leaves it: every parameter (A_log and dt_bias too)
    in ``dtype``, the MoE buffers (expert bias, token counts) fp32. Reload weights afterwards for exact values."""
    model.to(dtype=dtype)
    for module in model.modules():
        for name in ("expert_bias_E", "tokens_per_expert_E"):
            buffer = getattr(module, name, None)
            if isinstance(buffer, torch.Tensor):
                setattr(module, name, buffer.float())
    return model


def use_fp32_experts(model: torch.nn.Module, enable: bool = True) -> None:
    """Make the port's routed experts compute in the input's dtype (fp32 for an fp32 model) instead of bf16: a
    per-expert matmul loop replaces ``torch._grouped_mm`` (which wants bf16). For parity diagnostics only;
    ``enable=False`` restores the port's own experts."""
    port = import_port()
    for module in model.modules():
        if isinstance(module, port.KimiGroupedExperts):
            if enable:
                module.forward = types.MethodType(_experts_in_input_dtype, module)
            else:
                module.__dict__.pop("forward", None)


def _experts_in_input_dtype(self: Any, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    from torchtitan.models.kimi_k3.moe import _situ_glu

    counts = num_tokens_per_expert_E.tolist()
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        x = x_RD[start:start + int(count)]
        start += int(count)
        gate = x @ self.w1_EFD[expert].to(x.dtype).T
        up = x @ self.w3_EFD[expert].to(x.dtype).T
        outputs.append(_situ_glu(gate, up, self.beta, self.linear_beta) @ self.w2_EDF[expert].to(x.dtype).T)
    return torch.cat(outputs) if outputs else x_RD.new_zeros(0, self.w2_EDF.shape[1])


def use_reference_kda(model: torch.nn.Module) -> None:
    """Replace fla's ``chunk_kda`` in the port's KDA layers by a token-by-token torch recurrence with the same
    numerics (the kernel's gate, q/k L2 norm with eps 1e-6, beta sigmoid, scale K^-0.5), so the port runs where
    Triton cannot (CPU checks). Slow: short sequences only."""
    import_port()
    kernel_cls = importlib.import_module("torchtitan.models.kimi_k3.kda").KimiKDAKernel
    for module in model.modules():
        if isinstance(module, kernel_cls):
            module.forward = types.MethodType(_reference_kda, module)


def _reference_kda(self: Any, q_BLHK: torch.Tensor, k_BLHK: torch.Tensor, v_BLHV: torch.Tensor,
                   gate_BLHK: torch.Tensor, beta_BLH: torch.Tensor, A_log_H: torch.Tensor,
                   dt_bias_HK: torch.Tensor) -> torch.Tensor:
    from fla.ops.kda.gate import naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_recurrent_kda

    if self.lower_bound is None:
        raise NotImplementedError("the reference KDA covers the bounded (safe) gate only")
    g = naive_kda_lowerbound_gate(gate_BLHK, A_log_H, dt_bias_HK.reshape(-1), self.lower_bound)
    q = q_BLHK.float() * torch.rsqrt(q_BLHK.float().pow(2).sum(-1, keepdim=True) + 1e-6)
    k = k_BLHK.float() * torch.rsqrt(k_BLHK.float().pow(2).sum(-1, keepdim=True) + 1e-6)
    out, _ = naive_recurrent_kda(q, k, v_BLHV, g, torch.sigmoid(beta_BLH.float()))
    return out.to(v_BLHV.dtype)


def attention_masks(model: torch.nn.Module, num_tokens: int, device: torch.device | str) -> Any:
    """The port's masks for one document of ``num_tokens`` tokens, cached on the model per (length, device):
    building a BlockMask runs a compiled ``create_block_mask``."""
    cache = model.__dict__.setdefault("_kimik3_mask_cache", {})
    key = (num_tokens, str(torch.device(device)))
    if key not in cache:
        positions = torch.arange(num_tokens, dtype=torch.int32, device=device)
        cache[key] = model.get_attention_masks(positions)
    return cache[key]


def port_logits(model: torch.nn.Module, tokens_T: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] (in the model's dtype) of one document ``tokens_T`` [T]."""
    if tokens_T.ndim != 1:
        raise ValueError(f"the port takes one document per call: tokens must be 1-D, got {tuple(tokens_T.shape)}")
    num_tokens = tokens_T.shape[0]
    positions = torch.arange(num_tokens, dtype=torch.int32, device=tokens_T.device)
    return model(tokens_T, positions=positions,
                 attention_masks=attention_masks(model, num_tokens, tokens_T.device))


def port_loss(model: torch.nn.Module, tokens_T: torch.Tensor, labels_T: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32) over ``labels_T != -100``; labels already shifted (``labels[t]`` is
    the target of position t), as ours takes them. Main CE only: the port has no MTP module."""
    logits_TV = port_logits(model, tokens_T)
    return F.cross_entropy(logits_TV.float(), labels_T, ignore_index=IGNORE_INDEX)


def port_train_loss(model: torch.nn.Module, tokens_BT: torch.Tensor, labels_BT: torch.Tensor, *,
                    backward: bool = False) -> torch.Tensor:
    """Mean cross-entropy over every valid label of a [B, T] batch, the objective ours computes for the same batch
    (less MTP). The port takes one document per call, so the B rows run one after another; each row's CE is
    weighted by its share of the batch's valid labels.

    ``backward=False``: returns the loss with its graph (B rows of activations held until ``loss.backward()``).
    ``backward=True``: runs each row's backward right after its forward (one row of activations at a time, the
    same gradients), and returns the detached loss; call the optimizer step afterwards as usual."""
    if tokens_BT.ndim != 2 or tokens_BT.shape != labels_BT.shape:
        raise ValueError(f"tokens and labels must both be [B, T], got {tuple(tokens_BT.shape)} "
                         f"and {tuple(labels_BT.shape)}")
    valid_B = (labels_BT != IGNORE_INDEX).sum(1)
    total = valid_B.sum().clamp(min=1).float()
    loss = torch.zeros((), device=tokens_BT.device)
    for row in range(tokens_BT.shape[0]):
        logits_TV = port_logits(model, tokens_BT[row])
        row_loss = F.cross_entropy(logits_TV.float(), labels_BT[row], ignore_index=IGNORE_INDEX,
                                   reduction="sum") / total
        if backward:
            row_loss.backward()
            loss += row_loss.detach()
        else:
            loss = loss + row_loss
    return loss


# ---------------------------------------------------------------------------------------------------- our weights
def load_ours_into_port(port_model: torch.nn.Module, our_model: torch.nn.Module) -> None:
    """Copy our model's weights into the port (``kimik3.interop.to_torchtitan``, without our MTP module), after a
    strict check that the keys and shapes are exactly the port's; raises ValueError listing every difference.
    Each tensor takes the port's dtype and device."""
    state = port_state_from_ours(our_model)
    target = port_model.state_dict()
    problems = state_dict_diff(state, target)
    if problems:
        raise ValueError("our weights (to_torchtitan) do not match the port's state dict:\n  " + "\n  ".join(problems))
    with torch.no_grad():
        for key, value in state.items():
            target[key].copy_(value.to(dtype=target[key].dtype, device=target[key].device))


OUR_MTP_PREFIX = "mtp."


def load_port_into_ours(our_model: torch.nn.Module, port_model: torch.nn.Module) -> None:
    """Copy the port's weights into our model (``kimik3.interop.from_torchtitan``), strictly: a port tensor the
    adapter cannot map, one it needs and does not find, or a shape mismatch raises ValueError naming each. The
    port has no MTP module: ours keeps its own MTP weights (they do not enter the main logits). Each tensor takes
    our dtype and device (a bf16 port's values land in our fp32 ``A_log``/``dt_bias`` as they are)."""
    state = ours_state_from_port(port_model, our_model.config)
    target = our_model.state_dict()
    compared = {key: value for key, value in target.items() if not key.startswith(OUR_MTP_PREFIX)}
    problems = state_dict_diff(state, compared, names=("the port (converted)", "ours"))
    if problems:
        raise ValueError("the port's weights (from_torchtitan) do not match our state dict:\n  "
                         + "\n  ".join(problems))
    with torch.no_grad():
        for key, value in state.items():
            target[key].copy_(value.to(dtype=target[key].dtype, device=target[key].device))


def ours_state_from_port(port_model: torch.nn.Module, our_config: Any) -> dict[str, torch.Tensor]:
    """The port's state dict in our names (without an MTP module, which the port does not have); raises ValueError
    naming every port key the adapter does not map."""
    from kimik3.interop import from_torchtitan

    no_mtp = dataclasses.replace(our_config, mtp=dataclasses.replace(our_config.mtp, num_modules=0))
    return from_torchtitan(port_model.state_dict(), no_mtp)


# The tensors the port's init sets to a constant (``_NORM_INIT`` ones, ``dt_bias`` zeros, the MoE's expert-bias
# buffer zeros): leaf-name suffix -> the value. Every other tensor of its state dict is drawn at random.
PORT_INIT_CONSTANTS = {"norm.weight": 1.0, "dt_bias": 0.0, "expert_bias_E": 0.0}


def port_init_constant(name: str) -> float | None:
    """The constant the port's init gives the state-dict entry ``name``, or None where it draws it at random."""
    for suffix, value in PORT_INIT_CONSTANTS.items():
        if name.endswith(suffix):
            return value
    return None


def constant_tensors(model: torch.nn.Module) -> list[str]:
    """State-dict entries of more than one element whose elements all equal one value."""
    out = []
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        if flat.numel() > 1 and bool((flat == flat[0]).all()):
            out.append(name)
    return out


def check_port_init(model: torch.nn.Module) -> None:
    """Check that a freshly built port is initialised as its config says: the entries of ``PORT_INIT_CONSTANTS`` at
    their constant, every other tensor finite and not constant (``to_empty`` memory an init missed would be zeros
    or garbage). Raises RuntimeError naming every entry that is not."""
    problems = []
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1).float()
        expected = port_init_constant(name)
        if not bool(torch.isfinite(flat).all()):
            problems.append(f"{name}: not finite")
        elif expected is not None:
            if not bool((flat == expected).all()):
                problems.append(f"{name}: expected the constant {expected:g} of the port's init")
        elif flat.numel() > 1 and not bool((flat != flat[0]).any()):
            problems.append(f"{name}: constant {flat[0].item():g}, expected a random draw")
    if problems:
        raise RuntimeError("the port's init is not what its config says:\n  " + "\n  ".join(problems))


def port_state_from_ours(our_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from kimik3.interop import to_torchtitan

    return to_torchtitan(our_model.state_dict(), our_model.config, include_mtp=False)


def state_dict_diff(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor], limit: int = 40, *,
                    names: tuple[str, str] = ("ours", "the port")) -> list[str]:
    """Readable differences of keys and shapes between a converted ``source`` and the ``target`` model's state
    dict: target keys the source lacks, source keys the target does not know, shape mismatches. ``names``: how
    the two are called in the lines (source, target)."""
    src, dst = names
    lines = []
    missing = sorted(set(target) - set(source))
    unexpected = sorted(set(source) - set(target))
    shapes = sorted(k for k in set(source) & set(target) if tuple(source[k].shape) != tuple(target[k].shape))
    for title, keys, show in ((f"key of {dst} missing from {src}", missing, lambda k: f"{tuple(target[k].shape)}"),
                              (f"key of {src} unknown to {dst}", unexpected, lambda k: f"{tuple(source[k].shape)}"),
                              ("shape differs", shapes,
                               lambda k: f"{src} {tuple(source[k].shape)} vs {dst} {tuple(target[k].shape)}")):
        if keys:
            lines.append(f"{title} ({len(keys)}):")
            lines += [f"  {k} {show(k)}" for k in keys[:limit]]
            if len(keys) > limit:
                lines.append(f"  ... and {len(keys) - limit} more")
    return lines
