"""The socket thread's view of requests in flight, indexed every way it needs.

Written only by the socket thread. A flight exists from the moment a work request is accepted
until its terminal event (done or error) is sent or its client is found gone; after that the
engine's outputs for it are dropped, which is what makes "no token after the ack" hold.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

from llmd.sentences import SentenceSplitter


@dataclass(eq=False)
class Flight:
    ident: bytes                     # the client's ZeroMQ routing id
    client_id: str                   # the id the client chose
    engine_id: str                   # unique within the daemon's life
    kind: str
    arrival: float = field(default_factory=time.monotonic)
    deadline: Optional[float] = None     # monotonic seconds
    replace_key: Optional[str] = None
    splitter: Optional[SentenceSplitter] = None
    seq: int = 0                     # next token event number
    sentence_seq: int = 0
    tokens: int = 0
    first_token_at: Optional[float] = None
    last_sent: float = field(default_factory=time.monotonic)
    stream: bool = True              # False: the output is held here and sent whole before done
    held: list = field(default_factory=list)     # (text, token ids, logprobs) per engine step


class FlightTable:
    def __init__(self):
        self._by_engine: dict[str, Flight] = {}
        self._by_client: dict[tuple[bytes, str], Flight] = {}
        self._by_replace: dict[tuple[bytes, str], Flight] = {}
        self._by_ident: dict[bytes, set[str]] = {}

    def __len__(self) -> int:
        return len(self._by_engine)

    def __iter__(self) -> Iterator[Flight]:
        return iter(list(self._by_engine.values()))

    def add(self, f: Flight) -> None:
        self._by_engine[f.engine_id] = f
        self._by_client[(f.ident, f.client_id)] = f
        self._by_ident.setdefault(f.ident, set()).add(f.engine_id)
        if f.replace_key is not None:
            self._by_replace[(f.ident, f.replace_key)] = f

    def remove(self, f: Flight) -> None:
        if self._by_engine.pop(f.engine_id, None) is None:
            return
        self._by_client.pop((f.ident, f.client_id), None)
        if f.replace_key is not None and self._by_replace.get((f.ident, f.replace_key)) is f:
            del self._by_replace[(f.ident, f.replace_key)]
        ids = self._by_ident.get(f.ident)
        if ids is not None:
            ids.discard(f.engine_id)
            if not ids:
                del self._by_ident[f.ident]

    def by_engine(self, engine_id: str) -> Optional[Flight]:
        return self._by_engine.get(engine_id)

    def by_client(self, ident: bytes, client_id: str) -> Optional[Flight]:
        return self._by_client.get((ident, client_id))

    def by_replace(self, ident: bytes, key: str) -> Optional[Flight]:
        return self._by_replace.get((ident, key))

    def of_ident(self, ident: bytes) -> list[Flight]:
        return [self._by_engine[e] for e in self._by_ident.get(ident, ())]

    def idents(self) -> list[bytes]:
        return list(self._by_ident)
