"""Fixed-length windows over a byte-token stream, a deterministic train/validation split, and the DataModule.

Split: the token stream is cut into chunks of 64 KiB (65,536 tokens) and every 20th chunk (chunk index ``i`` with
``i % 20 == 19``) goes to validation, i.e. 5% of the data spread evenly through the corpus; the rest, in order, is
the training stream. The split depends only on the token stream, never on a seed or the number of ranks.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from lightning_par.data.corpus import build_token_file, load_tokens
from lightning_par.data.tokenize import build_tokenized_file, load_tokenizer
from lightning_par.data.resumable import ResumableDataLoader

__all__ = [
    "VOCAB_SIZE",
    "ByteCorpusDataModule",
    "TokenWindowDataset",
    "make_synthetic_tokens",
    "split_lengths",
    "split_tokens",
]

#: Byte-level vocabulary: one token per byte value.
VOCAB_SIZE = 256


def split_tokens(tokens: np.ndarray, val_every: int = 20, chunk: int = 65536) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic, disjoint train/validation split of a 1-D token stream.

    Chunk ``i`` (tokens ``[i * chunk, (i + 1) * chunk)``, the last one possibly shorter) goes to validation when
    ``i % val_every == val_every - 1`` and to training otherwise; each side keeps the stream order.

    Args:
        tokens: ``(n_tokens,)`` array (a memmap is fine; the result is a copy in memory).
        val_every: one chunk in ``val_every`` is validation.
        chunk: chunk length in tokens.

    Returns:
        ``(train, val)``, 1-D arrays of ``tokens.dtype``; ``val`` is empty if there are fewer than ``val_every``
        chunks.

    Raises:
        ValueError: ``tokens`` is not 1-D, or ``val_every < 2`` or ``chunk < 1``.
    """
    if tokens.ndim != 1:
        raise ValueError(f"tokens of shape {tokens.shape} is not valid: expected a 1-D array.")
    if isinstance(val_every, bool) or not isinstance(val_every, int) or val_every < 2:
        raise ValueError(f"val_every={val_every!r} is not valid: expected an integer >= 2.")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} is not valid: expected a positive integer.")
    n_chunks = -(-len(tokens) // chunk)
    is_val = np.arange(n_chunks) % val_every == val_every - 1
    pieces = [np.asarray(tokens[i * chunk : (i + 1) * chunk]) for i in range(n_chunks)]
    empty = np.empty(0, dtype=tokens.dtype)
    train = np.concatenate([p for p, v in zip(pieces, is_val) if not v] or [empty])
    val = np.concatenate([p for p, v in zip(pieces, is_val) if v] or [empty])
    return train, val


def split_lengths(n_tokens: int, val_every: int = 20, chunk: int = 65536) -> tuple[int, int]:
    """``(len(train), len(val))`` of :func:`split_tokens` for a stream of ``n_tokens``, without the tokens."""
    n_chunks = -(-n_tokens // chunk)
    val = 0
    for i in range(val_every - 1, n_chunks, val_every):
        val += min(chunk, n_tokens - i * chunk)
    return n_tokens - val, val


def make_synthetic_tokens(n_tokens: int, seed: int = 1234, alphabet_size: int = 64, noise: float = 0.1) -> np.ndarray:
    """A learnable, deterministic byte stream for fast tests: a noisy Markov chain over a small alphabet.

    Each next byte is ``successor[current]`` (a fixed random permutation of the alphabet) with probability
    ``1 - noise`` and a uniformly random alphabet byte otherwise. A model first learns the alphabet
    (``ln 256 = 5.55`` -> ``ln 64 = 4.16`` nats) and then the successor map (entropy about 0.73 nats per token for
    the defaults).

    Args:
        n_tokens: stream length.
        seed: seed of the ``numpy`` generator; the same seed gives the same stream.
        alphabet_size: distinct printable bytes used, in ``[2, 95]``.
        noise: probability of a random byte, in ``[0, 1]``.

    Returns:
        ``(n_tokens,)`` uint8 array.
    """
    rng = np.random.default_rng(seed)
    alphabet = rng.permutation(np.arange(32, 127, dtype=np.int64))[:alphabet_size]
    successor = rng.permutation(alphabet_size)
    random_next = rng.integers(0, alphabet_size, size=n_tokens)
    use_random = rng.random(n_tokens) < noise
    state = np.empty(n_tokens, dtype=np.int64)
    current = int(random_next[0])
    succ, rnd, flip = successor.tolist(), random_next.tolist(), use_random.tolist()
    for i in range(n_tokens):
        state[i] = current
        current = rnd[i] if flip[i] else succ[current]
    return alphabet[state].astype(np.uint8)


class TokenWindowDataset(Dataset):
    """Non-overlapping next-token windows over a 1-D token array.

    Item ``i`` is ``(x, y)`` with ``x = tokens[i * block_size : (i + 1) * block_size]`` and ``y`` the same window
    shifted one token right; both int64 tensors of shape ``(block_size,)``. ``len = (n_tokens - 1) // block_size``.

    Args:
        tokens: ``(n_tokens,)`` integer array (uint8 for bytes; a memmap is read lazily).
        block_size: window length in tokens.

    Raises:
        ValueError: ``tokens`` is not 1-D or ``block_size`` is not a positive integer.
    """

    def __init__(self, tokens: np.ndarray, block_size: int) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"tokens of shape {tokens.shape} is not valid: expected a 1-D array.")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} is not valid: expected a positive integer.")
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"window index {index} is out of range for {n} windows.")
        start = (index % n) * self.block_size
        window = torch.from_numpy(np.asarray(self.tokens[start : start + self.block_size + 1], dtype=np.int64))
        return window[:-1], window[1:]


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"ByteCorpusDataModule {name}={value!r} is not valid: expected an integer >= {minimum}.")


class ByteCorpusDataModule(L.LightningDataModule):
    """Language-modelling data: the standard library, a user file or directory, or a synthetic stream; byte tokens,
    or the ids of a local Hugging Face tokenizer (``tokenizer``).

    Args:
        path: file or directory to train on; None for the standard-library corpus (see ``corpus.py``).
        block_size: tokens per window (``seq`` of the model input).
        batch_size: micro-batch per data-parallel rank, in windows.
        num_workers: DataLoader worker processes.
        synthetic: use :func:`make_synthetic_tokens` (no files, for fast tests) instead of ``path``.
        synthetic_tokens: length of the synthetic stream.
        seed: seed of the synthetic stream and of the single-process shuffle.
        cache_dir: token cache directory; ``$LP_CACHE_DIR`` or ``~/.cache/lightning_par`` if None.
        val_batches: if set, validation uses only the first ``val_batches * batch_size`` validation windows (in
            total, shared among data-parallel ranks), to keep validation short.
        tokenizer: a local tokenizer directory (``tokenizer.json``, or what ``AutoTokenizer`` reads offline): the
            corpus is tokenized once into a cached token file (:mod:`lightning_par.data.tokenize`) and
            :attr:`vocab_size` is the tokenizer's. None: one token per byte.

    Raises:
        ValueError: an invalid argument, a missing path, or (in :meth:`setup`) a corpus too small to give one
            training batch and one validation window.
    """

    def __init__(
        self,
        path: str | None = None,
        block_size: int = 128,
        batch_size: int = 16,
        num_workers: int = 0,
        synthetic: bool = False,
        synthetic_tokens: int = 200_000,
        seed: int = 1234,
        cache_dir: str | None = None,
        val_batches: int | None = None,
        tokenizer: str | None = None,
    ) -> None:
        super().__init__()
        _check_int("block_size", block_size, 1)
        _check_int("batch_size", batch_size, 1)
        _check_int("num_workers", num_workers, 0)
        _check_int("synthetic_tokens", synthetic_tokens, 2)
        _check_int("seed", seed, 0)
        if val_batches is not None:
            _check_int("val_batches", val_batches, 1)
        if path is not None and synthetic:
            raise ValueError(
                f"ByteCorpusDataModule path={path!r} is not valid with synthetic=True: the synthetic stream ignores it. "
                f"Expected path=None with synthetic=True, or synthetic=False to train on {path!r}."
            )
        if path is not None and not Path(path).expanduser().exists():
            raise ValueError(
                f"ByteCorpusDataModule path={path!r} is not valid: it does not exist. Expected an existing file or "
                f"directory, or None for the Python standard library."
            )
        if tokenizer is not None and synthetic:
            raise ValueError(
                f"ByteCorpusDataModule tokenizer={tokenizer!r} is not valid with synthetic=True: the synthetic stream is "
                f"bytes. Expected tokenizer=None with synthetic=True, or synthetic=False to tokenize a text corpus."
            )
        self._vocab_size = VOCAB_SIZE if tokenizer is None else load_tokenizer(tokenizer)[1]
        self.save_hyperparameters()
        self.tokenizer = tokenizer
        self.path = path
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.synthetic = synthetic
        self.synthetic_tokens = synthetic_tokens
        self.seed = seed
        self.cache_dir = cache_dir
        self.val_batches = val_batches
        self.train_dataset: TokenWindowDataset | None = None
        self.val_dataset: Dataset | None = None

    @property
    def vocab_size(self) -> int:
        """Number of distinct tokens: 256 (one per byte value), or the tokenizer's vocabulary size."""
        return self._vocab_size

    def token_file(self) -> Path:
        """The cached token file of the corpus (built on first use): bytes, or the tokenizer's ids."""
        if self.tokenizer is not None:
            return build_tokenized_file(self.path, self.tokenizer, self.cache_dir)[0]
        return build_token_file(self.path, self.cache_dir)

    def prepare_data(self) -> None:
        """Build the token cache (Lightning calls this on local rank 0 only)."""
        if not self.synthetic:
            self.token_file()

    def _tokens(self) -> np.ndarray:
        if self.synthetic:
            return make_synthetic_tokens(self.synthetic_tokens, seed=self.seed)
        return load_tokens(self.token_file())

    def _chunk(self, n_tokens: int) -> int:
        return min(65536, max(self.block_size + 1, n_tokens // 20))

    def _check_size(self, n_tokens: int, replicas: int = 1) -> None:
        train, val = split_lengths(n_tokens, val_every=20, chunk=self._chunk(n_tokens))
        n_train, n_val = max(0, (train - 1) // self.block_size), max(0, (val - 1) // self.block_size)
        source = "synthetic=True" if self.synthetic else ("the standard library" if self.path is None else f"path={self.path!r}")
        if n_train < self.batch_size or n_val < 1:
            raise ValueError(
                f"corpus ({source}) of {n_tokens} tokens is too small for block_size={self.block_size} and "
                f"batch_size={self.batch_size}: it gives {n_train} training and {n_val} validation "
                f"windows. Expected at least {self.batch_size} and 1; use a larger corpus or smaller sizes."
            )
        # The distributed sampler gives each dp replica ceil(n_train / replicas) windows, and the loader drops the
        # last incomplete batch: fewer windows than one batch per replica would train 0 steps.
        per_replica = -(-n_train // replicas)
        if per_replica < self.batch_size:
            raise ValueError(
                f"corpus ({source}) of {n_tokens} tokens is too small for dp_size={replicas}, "
                f"batch_size={self.batch_size} and block_size={self.block_size}: its {n_train} training windows give "
                f"each of the {replicas} dp replicas {per_replica}, fewer than one batch (the last incomplete batch is "
                f"dropped), so no step would train. Expected at least dp_size * batch_size = "
                f"{replicas * self.batch_size} windows; use a larger corpus, a smaller batch_size or block_size, or "
                f"fewer dp replicas."
            )

    def check_corpus(self, replicas: int = 1) -> None:
        """Build the token cache if needed and check that the corpus gives one training batch per dp replica and one
        validation window, from its length only (no tokens are read), before any process starts.

        Args:
            replicas: the dp replicas the training windows are split over (``dp_size``).

        Raises:
            ValueError: the corpus is too small for ``block_size``, ``batch_size`` and ``replicas``.
        """
        if self.synthetic:
            self._check_size(self.synthetic_tokens, replicas)
        else:
            self._check_size(len(load_tokens(self.token_file())), replicas)

    def setup(self, stage: str | None = None) -> None:
        """Load the tokens, split them (see the module docstring) and make the window datasets; idempotent.

        Corpora shorter than 20 chunks of 64 KiB use chunks of ``max(block_size + 1, n_tokens // 20)`` tokens so
        that validation is never empty.
        """
        if self.train_dataset is not None:
            return
        tokens = self._tokens()
        self._check_size(len(tokens))
        train, val = split_tokens(tokens, val_every=20, chunk=self._chunk(len(tokens)))
        train_ds = TokenWindowDataset(train, self.block_size)
        val_ds: Dataset = TokenWindowDataset(val, self.block_size)
        if self.val_batches is not None:
            val_ds = Subset(val_ds, range(min(len(val_ds), self.val_batches * self.batch_size)))
        self.train_dataset, self.val_dataset = train_ds, val_ds

    def train_dataloader(self) -> DataLoader:
        """Shuffled, ``drop_last`` batches ``(x, y)`` of shape ``(batch_size, block_size)`` each.

        Under a distributed strategy Lightning swaps the sampler for a ``DistributedSampler`` over the data-parallel
        ranks; in a single process the shuffle is seeded by ``seed``. The loader is a
        :class:`~lightning_par.data.resumable.ResumableDataLoader`: a run resumed from a mid-epoch checkpoint
        continues with the batch that followed it.
        """
        if self.train_dataset is None:
            self.setup("fit")
        return ResumableDataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def val_dataloader(self) -> DataLoader:
        """Batches ``(x, y)`` of validation windows in corpus order (the last batch may be short)."""
        if self.val_dataset is None:
            self.setup("validate")
        return DataLoader(
            self.val_dataset,
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
