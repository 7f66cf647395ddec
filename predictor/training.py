"""One minibatch training loop shared by the MoE phases and the baselines."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from predictor.progress import Progress

__all__ = ["TrainConfig", "log_length_loss", "train_loop"]


@dataclass(frozen=True)
class TrainConfig:
    epochs: int
    batch_size: int
    learning_rate: float
    weight_decay: float
    loss: str  # "l1" | "huber" on log length
    show_progress: bool = False


def log_length_loss(pred_log: torch.Tensor, target_log: torch.Tensor, loss: str) -> torch.Tensor:
    """L1 on log length estimates the median length, which is what minimises MAE."""
    if loss == "l1":
        return F.l1_loss(pred_log, target_log)
    if loss == "huber":
        return F.huber_loss(pred_log, target_log, delta=0.25)
    raise ValueError(f"unknown loss {loss!r}; expected 'l1' or 'huber'")


def train_loop(
    parameters: Iterable[torch.nn.Parameter],
    num_rows: int,
    batch_loss: Callable[[np.ndarray], torch.Tensor],
    config: TrainConfig,
    gen: torch.Generator,
    desc: str,
) -> list[float]:
    """AdamW over shuffled minibatches; `batch_loss(row_ids)` builds each batch's loss.

    Returns the mean loss of each epoch.
    """
    optimizer = torch.optim.AdamW(
        list(parameters), lr=config.learning_rate, weight_decay=config.weight_decay
    )
    epoch_losses: list[float] = []
    bar = Progress(range(config.epochs), desc=desc, unit="epochs", enabled=config.show_progress,
                   leave=False, lines=config.epochs)  # on a log: a line per epoch
    for _ in bar:
        order = torch.randperm(num_rows, generator=gen).numpy()
        total = 0.0
        for start in range(0, num_rows, config.batch_size):
            rows = order[start : start + config.batch_size]
            loss = batch_loss(rows)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(rows)
        epoch_losses.append(total / num_rows)
        bar.set_postfix(loss=f"{epoch_losses[-1]:.4f}")
    return epoch_losses
