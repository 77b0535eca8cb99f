"""Keyed pseudonyms of raw user ids, so that a dataset never holds them and only the key's holder
can map a raw id to its user.

An import with ``"pseudonymise": {"hash": "hmac-sha256" | "blake2b"}`` in its spec replaces each
raw user value (its text, UTF-8) by ``HMAC-SHA256(key, raw)`` or ``blake2b(raw, key=key)`` (32-byte
digests, hex) before user ids are given: ``user_id`` is then the rank of the pseudonym among the
sorted pseudonyms, where a plain import ranks the raw values. The dataset keeps the pseudonym of
every ``user_id`` (``pseudonyms.parquet``, row ``i`` = user ``i``) and a check value of the key,
never the key: it comes from a file (``--key-file``) or the environment variable ``KEY_ENV``, and
``opengem forget --raw-ids`` hashes a raw-id list with it to find the users.

A keyed hash and not a plain one: without the key, a pseudonym cannot be recomputed from a guessed
raw id (a plain hash of a phone number or an email is reversed by trying them all).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from opengem.data.parquet import DataError

HASHES = ("hmac-sha256", "blake2b")
KEY_ENV = "OPENGEM_PSEUDONYM_KEY"  # the key's text, when no key file is given
FILE = "pseudonyms.parquet"  # DATA/pseudonyms.parquet: column ``pseudonym``, one row per user id
MIN_KEY_BYTES = 16  # a shorter key could be found by trying keys


def load_key(key_file: str | Path | None = None) -> bytes:
    """The key: the bytes of ``key_file`` (a trailing newline dropped), else ``$KEY_ENV``'s text."""
    if key_file is not None:
        try:
            key = Path(key_file).read_bytes().rstrip(b"\r\n")
        except OSError as e:
            raise DataError(f"pseudonym key file {key_file}: unreadable ({e})") from e
        where = f"key file {key_file}"
    else:
        if not os.environ.get(KEY_ENV):
            raise DataError(f"pseudonymising needs a key: give --key-file FILE or set {KEY_ENV}")
        key, where = os.environ[KEY_ENV].encode(), f"${KEY_ENV}"
    if len(key) < MIN_KEY_BYTES:
        raise DataError(f"pseudonym key ({where}) has {len(key)} bytes; use at least "
                        f"{MIN_KEY_BYTES} random bytes (e.g. `head -c 32 /dev/urandom | base64`)")
    if len(key) > 64:  # blake2b's longest key; HMAC would hash it down anyway
        key = hashlib.sha256(key).digest()
    return key


def pseudonymise(raw: np.ndarray, key: bytes, method: str) -> np.ndarray:
    """Each raw value's pseudonym (64 hex characters), as a numpy array of str."""
    if method not in HASHES:
        raise DataError(f"pseudonymise.hash {method!r}: choose one of {list(HASHES)}")
    if method == "hmac-sha256":
        def one(v: str) -> str:
            return hmac.new(key, v.encode(), hashlib.sha256).hexdigest()
    else:
        def one(v: str) -> str:
            return hashlib.blake2b(v.encode(), key=key, digest_size=32).hexdigest()
    return np.array([one(v) for v in np.asarray(raw).astype(str)], dtype=object).astype(str)


def key_check(key: bytes, method: str) -> str:
    """A short value that tells the same key from another without revealing it: the pseudonym of
    a fixed text, cut to 16 hex characters (stored in the manifest; ``forget`` compares it)."""
    return str(pseudonymise(np.array(["opengem key check"]), key, method)[0][:16])


def write_pseudonyms(path: Path, sorted_pseudonyms: np.ndarray) -> None:
    """``DATA/pseudonyms.parquet``: row ``i`` is the pseudonym of user id ``i`` (null once
    forgotten)."""
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(pa.table({"pseudonym": pa.array(sorted_pseudonyms, pa.string())}), tmp,
                   compression="zstd")
    os.replace(tmp, path)


def user_ids_of(data_dir: str | Path, raw: np.ndarray, key: bytes,
                info: dict) -> tuple[np.ndarray, int]:
    """The user ids of raw ids in a pseudonymised dataset (``info``: the manifest's
    ``source.pseudonym``), and how many raw ids it does not hold (unknown or forgotten)."""
    if key_check(key, info["hash"]) != info["key_check"]:
        raise DataError(f"{data_dir}: the key given is not the one this dataset was imported "
                        f"with (key checks differ); the raw ids cannot be mapped")
    table = pq.read_table(Path(data_dir) / info["file"]).column("pseudonym")
    known = np.flatnonzero(table.is_valid().to_numpy(zero_copy_only=False))  # not forgotten
    have = np.asarray(table.to_pylist(), dtype=object)[known].astype(str)
    want = pseudonymise(raw, key, info["hash"])
    pos = np.clip(np.searchsorted(have, want), 0, max(len(have) - 1, 0))
    hit = (have[pos] == want) if len(have) else np.zeros(len(want), bool)
    return known[pos[hit]].astype(np.int64), int((~hit).sum())
