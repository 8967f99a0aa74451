"""The benchmark's models, and where their checkpoint sits.

``hooks``: a frozen and a trainable Linear per block, the host's cost per module call laid bare.
``lora``: LLM-shaped decoder blocks (RMSNorm, attention with q/k/v/o projections and LoRA on
q and v, RMSNorm, a SwiGLU MLP), between a frozen embedding and a frozen LM head; every base
weight is frozen, only LoRA trains. ``llama``: transformers' LlamaForCausalLM from a config
(random init, offline) with PEFT LoRA on q_proj and v_proj.

Each decoder layer runs inside a Checkpointed wrapper. Placement ``call`` checkpoints the
layer's ``__call__``, so its own ZeRO hooks run inside the recompute (transformers 4.x,
``checkpoint(layer, x)``); ``forward`` checkpoints ``layer.forward``, so they run outside
(transformers 5). Under reentrant checkpointing the embedding's output is made to require
grad, as TRL (``enable_input_require_grads``) does, or LoRA would get no gradient.
"""
import functools
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

LORA_RANK = 8


class Checkpointed(nn.Module):
    """Runs ``layer`` under torch's checkpoint (``reentrant`` True/False), or plainly (None)."""

    def __init__(self, layer: nn.Module, reentrant: Optional[bool], placement: str):
        super().__init__()
        self.layer = layer
        self.reentrant = reentrant
        self.placement = placement

    def forward(self, *args, **kwargs):
        if self.reentrant is None:
            return self.layer(*args, **kwargs)
        target = self.layer if self.placement == "call" else self.layer.forward
        if not args and "hidden_states" in kwargs:  # a layer called by keyword
            args = (kwargs.pop("hidden_states"),)
        # Reentrant checkpointing takes no keyword arguments: bind them first.
        return torch.utils.checkpoint.checkpoint(functools.partial(target, **kwargs), *args,
                                                 use_reentrant=self.reentrant)


class RMSNorm(nn.Module):

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, hidden):
        variance = hidden.float().pow(2).mean(-1, keepdim=True)
        return (hidden * torch.rsqrt(variance + 1e-6).to(hidden.dtype)) * self.weight


def frozen_linear(dim_in: int, dim_out: int) -> nn.Linear:
    return nn.Linear(dim_in, dim_out, bias=False).requires_grad_(False)


class LoRAProjection(nn.Module):
    """A frozen projection plus a trainable rank-``rank`` update, named as PEFT names it."""

    def __init__(self, dim_in: int, dim_out: int, rank: int = LORA_RANK):
        super().__init__()
        self.base_layer = frozen_linear(dim_in, dim_out)
        self.lora_A = nn.Linear(dim_in, rank, bias=False)
        self.lora_B = nn.Linear(rank, dim_out, bias=False)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


class DecoderLayer(nn.Module):

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.input_norm = RMSNorm(hidden)
        self.q_proj = LoRAProjection(hidden, hidden)
        self.k_proj = frozen_linear(hidden, hidden)
        self.v_proj = LoRAProjection(hidden, hidden)
        self.o_proj = frozen_linear(hidden, hidden)
        self.post_norm = RMSNorm(hidden)
        self.gate_proj = frozen_linear(hidden, 4 * hidden)
        self.up_proj = frozen_linear(hidden, 4 * hidden)
        self.down_proj = frozen_linear(4 * hidden, hidden)

    def _split(self, x):
        rows, seq, hidden = x.shape
        return x.view(rows, seq, self.heads, hidden // self.heads).transpose(1, 2)

    def forward(self, x):
        normed = self.input_norm(x)
        q, k, v = (self._split(proj(normed)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(attended.transpose(1, 2).reshape(x.shape))
        normed = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(normed)) * self.up_proj(normed))


class LoRADecoder(nn.Module):
    """Token ids in, mean cross-entropy of the next token out."""

    def __init__(self, blocks: int, hidden: int, heads: int, vocab: int, reentrant: Optional[bool], placement: str):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden).requires_grad_(False)
        self.layers = nn.ModuleList(
            Checkpointed(DecoderLayer(hidden, heads), reentrant, placement) for _ in range(blocks))
        self.norm = RMSNorm(hidden)
        self.lm_head = frozen_linear(hidden, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), input_ids[:, 1:].reshape(-1))


def _require_input_grads(embedding: nn.Module) -> None:
    embedding.register_forward_hook(lambda module, inputs, output: output.requires_grad_(True))


def build_lora(blocks: int, hidden: int, heads: int, vocab: int, reentrant: Optional[bool],
               placement: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = LoRADecoder(blocks, hidden, heads, vocab, reentrant, placement)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B.weight"):
                # PEFT starts B at zero; a small B gives A a gradient from the first step.
                param.normal_(0.0, 1.0 / math.sqrt(hidden))
    if reentrant:
        _require_input_grads(model.embed)
    return model


class _LossOf(nn.Module):
    """An HF causal LM whose call returns its loss, with labels = input ids."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, labels=input_ids).loss


def build_llama(blocks: int, hidden: int, heads: int, vocab: int, reentrant: Optional[bool],
                placement: str, seed: int) -> nn.Module:
    """LlamaForCausalLM + PEFT LoRA (q_proj, v_proj); its decoder layers wrapped in Checkpointed,
    so both placements run on any transformers version."""
    try:
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise RuntimeError(f"--model llama needs transformers and peft (pip install 'zero3-recompute[hf]'): "
                           f"{exc}") from exc
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=blocks, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=4096, use_cache=False, pad_token_id=None)
    llama = LlamaForCausalLM(config)
    decoder = llama.model
    decoder.layers = nn.ModuleList(Checkpointed(layer, reentrant, placement) for layer in decoder.layers)
    lora = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(llama, lora)
    if reentrant:
        _require_input_grads(llama.get_input_embeddings())
    return _LossOf(model)


class FrozenThenTrainable(nn.Module):
    """A frozen Linear, then a trainable one: the least work between two ZeRO-3 module calls."""

    def __init__(self, hidden: int):
        super().__init__()
        self.frozen = frozen_linear(hidden, hidden)
        self.trainable = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        return self.trainable(self.frozen(x))


class HookBound(nn.Module):
    """Token ids in, a frozen embedding, ``blocks`` checkpointed FrozenThenTrainable blocks, the mean
    square out: a step whose time is the host's, hooks included (``--model hooks``)."""

    def __init__(self, blocks: int, hidden: int, vocab: int, reentrant: Optional[bool], placement: str):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden).requires_grad_(False)
        self.layers = nn.ModuleList(
            Checkpointed(FrozenThenTrainable(hidden), reentrant, placement) for _ in range(blocks))

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return x.float().pow(2).mean()


def build_hooks(blocks: int, hidden: int, heads: int, vocab: int, reentrant: Optional[bool],
                placement: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = HookBound(blocks, hidden, vocab, reentrant, placement)
    if reentrant:
        _require_input_grads(model.embed)
    return model


BUILDERS = {"lora": build_lora, "llama": build_llama, "hooks": build_hooks}  # by options.MODELS
