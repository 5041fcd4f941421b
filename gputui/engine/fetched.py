"""Which DataLoader batches a script's own loop trains on, and its epochs.

Libraries fetch ahead: accelerate's DataLoaderShard (the Hugging Face Trainer's too) takes the
next batch from the DataLoader before it hands out the current one, to know which one is the
last. Counted when fetched, the first step would get two batches, the last none, and a run
stopped mid-epoch one it never trained on. So a fetched batch waits in its iterator's queue until
a backward() consumes it: each backward takes the oldest waiting batch of every iterator (two
loaders zipped train on one batch of each; gradient accumulation takes one per micro-batch).
Batches fetched with gradients off (an evaluation under no_grad or inference_mode) are not
queued, and what an iterator over other data than the training data leaves when it ends (an
evaluation pass) is dropped.

An epoch ends when an iterator over the training data (the data of the first batch a backward
consumed) is exhausted, and the next begins when a batch of that data is fetched again (a new
iterator, or a persistent one restarted): not at the exhaustion, which a loader fetching ahead
reaches before its last batch is trained on. A pass also ends at its last batch when the loader
knows its length: Lightning stops fetching there and never reaches StopIteration.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

import torch

from ..step.microbatch import batch_size

MAX_WAITING = 1024
"""Batches an iterator may hold unconsumed (an evaluation iterator kept alive, never ended)."""


class Fetched:
    def __init__(self) -> None:
        self._waiting: weakref.WeakKeyDictionary[Any, deque[tuple[int, int]]] = weakref.WeakKeyDictionary()
        self._training: Any = None  # the dataset the script trains on, once a backward consumed from it
        self._ended: Any = None  # the dataset whose pass ended last (the training data's, once known)
        self.epoch = 0  # the epoch of the batches fetched now, from 0
        self._samples = self._batches = 0  # consumed since the last take()
        self._step_epoch = 0

    @property
    def epochs_done(self) -> int:
        return self.epoch + (self._ended is not None and self._ended is self._training)

    def fetched(self, iterator: Any, batch: Any) -> None:
        """A DataLoader iterator returned `batch`."""
        if not torch.is_grad_enabled():
            return
        try:
            size = batch_size(batch)
        except (ValueError, TypeError):
            size = 0  # no batch dimension to read: a batch, of unknown samples
        data = getattr(iterator, "_dataset", None)
        if data is not None and data is self._ended and data is self._training:
            self._ended, self.epoch = None, self.epoch + 1
        waiting = self._waiting.get(iterator)
        if waiting is None:
            waiting = self._waiting[iterator] = deque(maxlen=MAX_WAITING)
        waiting.append((size, self.epoch))
        if _last_of_pass(iterator) and (self._training is None or data is self._training):
            self._ended = data  # the pass's last batch: still to be trained on, as at an exhaustion

    def exhausted(self, iterator: Any) -> None:
        """A DataLoader iterator raised StopIteration."""
        data = getattr(iterator, "_dataset", None)
        if self._training is None or data is self._training:
            self._ended = data  # what it fetched ahead is still to be trained on
        else:
            self._waiting.pop(iterator, None)

    def consume(self) -> None:
        """A backward(): it trained on the oldest waiting batch of each iterator."""
        for iterator, waiting in list(self._waiting.items()):
            if waiting:
                size, self._step_epoch = waiting.popleft()
                self._samples += size
                self._batches += 1
                if self._training is None:
                    self._training = getattr(iterator, "_dataset", None)

    def take(self) -> tuple[int, int]:
        """At an optimizer step: (samples, epoch) of the batches it trained on."""
        if not self._batches:  # no backward() since the last step (torch.autograd.grad?): what waits
            self.consume()
        samples, self._samples, self._batches = self._samples, 0, 0
        return samples, self._step_epoch


def _last_of_pass(iterator: Any) -> bool:
    """Whether `iterator` just yielded the last batch of its pass (a loader of known length)."""
    try:
        return bool(iterator._num_yielded >= len(iterator))
    except (AttributeError, TypeError):  # an iterable dataset without a length
        return False
