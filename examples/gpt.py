"""``ByteGPT``: a small GPT-style, byte-level (vocabulary 256) causal language model as a LightningModule.

Pre-LayerNorm transformer blocks written with plain PyTorch, learned position embeddings and an *untied* output
head (the head is its own ``nn.Linear``; with 256 tokens tying would save only ``256 * d_model`` parameters, and
keeping every parameter a distinct tensor keeps sharded state dicts simple).

The parameter count is set by ``n_layer`` and ``d_model``: about ``12 * n_layer * d_model**2`` plus the
embeddings, from ~1M (4 x 128) to ~300M (24 x 1024, the GPT-2 medium shape; GPT-2 medium's 355M includes a
50k-token embedding that a byte vocabulary does not need).
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

VOCAB_SIZE = 256


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention over ``F.scaled_dot_product_attention``.

    Args:
        d_model: Width of the residual stream.
        n_head: Number of heads; must divide ``d_model``.
        dropout: Dropout on the attention weights and on the output projection (training only).
    """

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model={d_model} is not divisible by n_head={n_head}.")
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend causally; ``x`` is ``(batch, time, d_model)``."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, n_head, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))`` with a 4x GELU MLP.

    Args:
        d_model: Width of the residual stream.
        n_head: Number of attention heads.
        dropout: Dropout probability.
    """

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``(batch, time, d_model)``."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_ratio: float = 0.1) -> float:
    """Learning-rate multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at ``max_steps``.

    Args:
        step: Optimizer steps taken so far.
        warmup_steps: Length of the linear warmup.
        max_steps: Step at which the cosine reaches ``min_ratio`` (held there afterwards).
        min_ratio: Final multiplier.

    Returns:
        The multiplier for the base learning rate.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class ByteGPT(pl.LightningModule):
    """GPT-style causal language model over raw bytes.

    Args:
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block.
        d_model: Width of the residual stream.
        block_size: Longest sequence the position embedding covers.
        dropout: Dropout probability (0 disables it).
        lr: Peak AdamW learning rate.
        weight_decay: AdamW weight decay for the matrices of ``nn.Linear`` layers (never biases, norms, embeddings).
        warmup_steps: Linear warmup steps of the schedule.
        max_steps: Length of the cosine schedule (usually the Trainer's ``max_steps``).
    """

    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        d_model: int = 128,
        block_size: int = 128,
        dropout: float = 0.0,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 10,
        max_steps: int = 60,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(VOCAB_SIZE, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB_SIZE, bias=False)
        self.apply(self._init_weights)
        # GPT-2 style: scale the residual output projections down with depth.
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def count_parameters(self, trainable_only: bool = False) -> int:
        """Number of parameters (every element of every parameter tensor).

        Args:
            trainable_only: Count only parameters with ``requires_grad``.

        Returns:
            The parameter count.
        """
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, time, 256)`` for byte ids ``idx`` of shape ``(batch, time)``."""
        t = idx.size(1)
        if t > self.hparams.block_size:
            raise ValueError(f"Sequence length {t} exceeds block_size={self.hparams.block_size}.")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.view(-1, VOCAB_SIZE), y.view(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Next-byte cross-entropy on one batch; logs ``train_loss``."""
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Next-byte cross-entropy on one validation batch; logs ``val_loss`` averaged over ranks."""
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW with two parameter groups (decay: Linear weights; no decay: the rest) + warmup/cosine per step."""
        decay, no_decay = [], []
        for module in self.modules():
            for name, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    continue
                (decay if isinstance(module, nn.Linear) and name == "weight" else no_decay).append(p)
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": hp.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=hp.lr,
            betas=(0.9, 0.95),
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, hp.warmup_steps, hp.max_steps)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
