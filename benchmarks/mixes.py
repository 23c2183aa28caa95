"""The tensor-size mixes the Trainer benchmarks save: real ``LightningModule``s trained with AdamW.

- ``huge``: a few huge tensors: ``Linear(4096, 8192)`` and two ``Linear(8192, 4096)``, bias-free (issue 12's model),
  with a ``BatchNorm1d(8192)`` between them: 3 weights of 128 MiB, after an AdamW step 1.13 GiB in 9 large tensors
  (plus the norm's 5 small ones and their AdamW state, and the scalar ``step`` tensors);
- ``gpt2``: GPT-2 small's parameter shapes (a 50257x768 embedding of 154 MB, 12 blocks of attention/MLP weights,
  biases and layer norms: 148 tensors, 124 M parameters): 1.49 GB with AdamW state;
- ``small``: many small tensors: 600 ``Linear(96, 96)`` with bias (37 KB and 384 B each): 3600 tensors, 67 MB;
- ``bert``: BERT-base's parameter shapes (a 30522x768 word embedding, position and token-type embeddings, 12 encoder
  layers of attention and feed-forward weights with biases and LayerNorms, a pooler behind a ``BatchNorm1d``): 110 M
  parameters, 1.32 GB;
- ``peers``: the workload the peer libraries were compared on in issue 23: a GPT-2-like model of width 1024 with
  16 blocks (separate query, key and value projections) and a 50257-token tied embedding: 253 M parameters, 1036
  tensors and 3.04 GB with AdamW state;
- ``conv``: a convnet of 400 ``Conv2d(64, 64, 3)`` + ``BatchNorm2d(64)`` (whose running statistics each forward
  pass updates in place): 2,800 model tensors, 177 MB with AdamW state.

``scale`` shrinks every width (``scale=0.05`` gives a checkpoint of a few MB for tests). Each training step runs a
real forward and backward over every parameter, so DDP all-reduces every gradient and AdamW updates every tensor.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, Dataset

__all__ = ["MIXES", "MixModule", "checkpoint_nbytes", "make_module"]

MIXES = ("huge", "gpt2", "small", "bert", "conv", "peers")


def _w(width: int, scale: float) -> int:
    return max(4, int(width * scale))


class _Huge(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        wide, narrow = _w(8192, scale), _w(4096, scale)
        self.up = nn.Linear(narrow, wide, bias=False)
        self.a = nn.Linear(wide, narrow, bias=False)
        self.b = nn.Linear(wide, narrow, bias=False)
        self.norm = nn.BatchNorm1d(wide)  # running statistics change in place in every forward pass
        self.width = narrow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.up(x)))
        return (self.a(h) * self.b(h)).mean()


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.mlp_proj = nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(self.ln_1(h)).chunk(3, dim=-1)
        h = h + self.c_proj(torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v)
        return h + self.mlp_proj(nn.functional.gelu(self.c_fc(self.ln_2(h))))


class _GPT2(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.width = _w(768, scale)
        self.wte = nn.Embedding(_w(50257, scale), self.width)
        self.wpe = nn.Embedding(_w(1024, scale), self.width)
        self.h = nn.ModuleList(_Block(self.width) for _ in range(12))
        self.ln_f = nn.LayerNorm(self.width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[-1]))
        for block in self.h:
            h = block(h)
        # The (tied) LM head: logits over the vocabulary, so the embedding's gradient is dense as in training.
        return nn.functional.cross_entropy((self.ln_f(h) @ self.wte.weight.T).flatten(0, 1), tokens.flatten())


class _Small(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.width = _w(96, max(scale, 0.5))
        self.layers = nn.ModuleList(nn.Linear(self.width, self.width) for _ in range(max(4, int(600 * scale))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


class _BertLayer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.query, self.key, self.value = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.attention_output = nn.Linear(width, width)
        self.attention_norm = nn.LayerNorm(width)
        self.intermediate = nn.Linear(width, 4 * width)
        self.output = nn.Linear(4 * width, width)
        self.output_norm = nn.LayerNorm(width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.query(h), self.key(h), self.value(h)
        attended = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v
        h = self.attention_norm(h + self.attention_output(attended))
        return self.output_norm(h + self.output(nn.functional.gelu(self.intermediate(h))))


class _Bert(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.width = _w(768, scale)
        self.word_embeddings = nn.Embedding(_w(30522, scale), self.width)
        self.position_embeddings = nn.Embedding(_w(512, scale), self.width)
        self.token_type_embeddings = nn.Embedding(2, self.width)
        self.embeddings_norm = nn.LayerNorm(self.width)
        self.layers = nn.ModuleList(_BertLayer(self.width) for _ in range(12))
        self.pooler_norm = nn.BatchNorm1d(self.width)  # running statistics change in place in every forward pass
        self.pooler = nn.Linear(self.width, self.width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[-1])
        h = self.word_embeddings(tokens) + self.position_embeddings(positions)
        h = self.embeddings_norm(h + self.token_type_embeddings(torch.zeros_like(tokens)))
        for layer in self.layers:
            h = layer(h)
        # A masked-LM head tied to the word embedding: its gradient is dense, as in pre-training.
        logits = (h @ self.word_embeddings.weight.T).flatten(0, 1)
        return (
            nn.functional.cross_entropy(logits, tokens.flatten())
            + torch.tanh(self.pooler(self.pooler_norm(h[:, 0]))).mean()
        )


class _Conv(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.width = _w(64, max(scale, 0.25))
        layers: list[nn.Module] = []
        for _ in range(max(4, int(400 * scale))):
            layers += [nn.Conv2d(self.width, self.width, 3, padding=1), nn.BatchNorm2d(self.width)]
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).square().mean()


class _PeersBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.ln_2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(h)
        q, k, v = self.q(x), self.k(x), self.v(x)
        h = h + self.o(torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v)
        return h + self.proj(nn.functional.gelu(self.fc(self.ln_2(h))))


class _Peers(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.width = _w(1024, scale)
        self.wte = nn.Embedding(_w(50257, scale), self.width)
        self.wpe = nn.Embedding(_w(512, scale), self.width)
        self.h = nn.ModuleList(_PeersBlock(self.width) for _ in range(16))
        self.ln_f = nn.LayerNorm(self.width, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[-1]))
        for block in self.h:
            h = block(h)
        return nn.functional.cross_entropy((self.ln_f(h) @ self.wte.weight.T).flatten(0, 1), tokens.flatten())


class _Batches(Dataset):
    """``length`` fixed random batches (token ids for ``gpt2``, floats otherwise)."""

    def __init__(self, mix: str, width: int, vocab: int, length: int) -> None:
        g = torch.Generator().manual_seed(0)
        if mix in ("gpt2", "bert", "peers"):
            self.items = torch.randint(0, vocab, (length, 2, 32), generator=g)
        elif mix == "conv":
            self.items = torch.randn(length, 2, width, 4, 4, generator=g)
        else:
            self.items = torch.randn(length, 8, width, generator=g)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i]


class MixModule(LightningModule):
    """A model of one mix (see the module docstring) trained with AdamW on fixed random batches.

    Args:
        mix: The tensor-size mix.
        scale: Width multiplier (1.0: the sizes of the module docstring).
        steps: Batches per epoch.
    """

    def __init__(self, mix: str, *, scale: float = 1.0, steps: int = 64) -> None:
        super().__init__()
        if mix not in MIXES:
            raise ValueError(f"mix must be one of {MIXES}, got {mix!r}")
        self.mix, self.steps = mix, steps
        self.net = {"huge": _Huge, "gpt2": _GPT2, "small": _Small, "bert": _Bert, "conv": _Conv, "peers": _Peers}[mix](
            scale
        )

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        vocab = {"gpt2": "wte", "peers": "wte", "bert": "word_embeddings"}.get(self.mix)
        vocab = getattr(self.net, vocab).num_embeddings if vocab else 0
        return DataLoader(_Batches(self.mix, self.net.width, vocab, self.steps), batch_size=1)


def make_module(mix: str, *, scale: float = 1.0, steps: int = 64) -> MixModule:
    """A seeded :class:`MixModule` (the same weights on every rank)."""
    torch.manual_seed(0)
    return MixModule(mix, scale=scale, steps=steps)


def checkpoint_nbytes(module: nn.Module) -> int:
    """Tensor bytes of the model plus AdamW state (weights, ``exp_avg``, ``exp_avg_sq``; ``step`` scalars)."""
    params = list(module.parameters())
    return sum(3 * p.nbytes for p in params) + 4 * len(params)
