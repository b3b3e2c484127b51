"""Cache-affine routing over server replicas, in plain Python: request keys, the replica-side key
report, and the routing decision. No Ray here (dasllama.server.ray wraps it in a Ray Serve request
router; benchmarks/sim_routing.py calls it directly with simulated replicas).

A request is cut into segments in prompt order: the tools, then per message its role, its text in
blocks of ``BLOCK`` characters and each audio / image part by a digest of its bytes (a media part's
content key, as the prefix cache keys its span by content). Each segment gets a chained key
(the digest of the previous key and the segment), so key i stands for the whole prefix up to
segment i, like the prefix cache's page-chain keys stand for a page and all pages before it.
A replica reports the keys of the prefixes its cache still holds; the router sends a request to the
replica holding the longest of its keys, unless that replica's load is past a bound.
"""
from __future__ import annotations

import base64
import collections
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

BLOCK = 256          # characters of text per segment
MEDIA_WEIGHT = 256   # a media segment's weight (about the rows of a short clip or a small image)


@dataclass(frozen=True)
class Keys:
    """A request's chained segment keys and the cumulative weight (characters; media count
    MEDIA_WEIGHT) up to each one."""

    keys: Tuple[int, ...]
    weights: Tuple[int, ...]

    @property
    def total(self) -> int:
        return self.weights[-1] if self.weights else 0

    def tag(self) -> str:
        """A short name of the whole prefix (its last key), for labelling a cache donation."""
        return f"{self.keys[-1]:016x}" if self.keys else ""


def _digest(prev: int, seg: bytes) -> int:
    h = hashlib.blake2b(prev.to_bytes(8, "little") + seg, digest_size=8, person=b"dasllama-route")
    return int.from_bytes(h.digest(), "little") >> 1  # 63 bits: an int every serializer keeps


def _media_segment(kind: str, data: str) -> Tuple[bytes, int]:
    # The digest of the payload as sent: the same clip resent byte for byte keys alike. (The engine's
    # content key is of the decoded samples; two encodings of one clip route apart but still match there.)
    return b"M" + kind.encode() + hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=16).digest(), \
        MEDIA_WEIGHT


def _text_segments(text: str) -> List[Tuple[bytes, int]]:
    return [(b"T" + text[i:i + BLOCK].encode("utf-8", "surrogatepass"), len(text[i:i + BLOCK]))
            for i in range(0, len(text), BLOCK)]


def _segments(body: dict) -> List[Tuple[bytes, int]]:
    segs: List[Tuple[bytes, int]] = []
    if "messages" in body:
        if body.get("tools"):
            segs.append((b"U" + json.dumps(body["tools"], sort_keys=True).encode(), 64))
        for m in body.get("messages") or ():
            if not isinstance(m, dict):
                continue
            segs.append((b"R" + str(m.get("role", "")).encode(), 4))
            content = m.get("content")
            if isinstance(content, str):
                segs += _text_segments(content)
            elif isinstance(content, list):
                for part in content:
                    if not isinstance(part, dict):
                        continue
                    t = part.get("type")
                    if t == "text" and isinstance(part.get("text"), str):
                        segs += _text_segments(part["text"])
                    elif t == "input_audio" and isinstance(part.get("input_audio"), dict):
                        segs.append(_media_segment("a", str(part["input_audio"].get("data", ""))))
                    elif t == "image_url":
                        u = part.get("image_url")
                        segs.append(_media_segment("i", str(u.get("url", "") if isinstance(u, dict) else u)))
            for call in m.get("tool_calls") or ():
                segs.append((b"C" + json.dumps(call, sort_keys=True).encode(), 16))
    elif isinstance(body.get("prompt"), str):
        segs += _text_segments(body["prompt"])
    return segs


def _chain(segs: List[Tuple[bytes, int]], prev: int = 0, total: int = 0) -> Tuple[List[int], List[int]]:
    keys, weights = [], []
    pending, pending_w = b"", 0
    for seg, w in segs:
        if seg[:1] == b"R":  # a role marker joins the message's first segment: no key of its own, so
            pending, pending_w = pending + seg, pending_w + w  # "user:" alone matches no other conversation
            continue
        prev = _digest(prev, pending + seg)
        total += w + pending_w
        pending, pending_w = b"", 0
        keys.append(prev)
        weights.append(total)
    if pending:
        keys.append(_digest(prev, pending))
        weights.append(total + pending_w)
    return keys, weights


def request_keys(body: object) -> Keys:
    """The chained keys of an OpenAI chat or completion request body (a dict); no keys for anything
    else (such a request routes by load alone)."""
    if not isinstance(body, dict):
        return Keys((), ())
    keys, weights = _chain(_segments(body))
    return Keys(tuple(keys), tuple(weights))


def reply_keys(prompt: Keys, body: dict, reply_text: str) -> Keys:
    """The keys of the prompt followed by the assistant's reply as the next turn will send it back
    (the cache holds the reply's pages too)."""
    if "messages" not in body or not prompt.keys:
        return prompt
    keys, weights = _chain([(b"Rassistant", 4)] + _text_segments(reply_text), prompt.keys[-1], prompt.weights[-1])
    return Keys(prompt.keys + tuple(keys), prompt.weights + tuple(weights))


def body_of(raw: bytes) -> object:
    """A request body parsed for routing only: anything unparsable routes by load (the replica answers it)."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None


# ---- replica side: what the cache holds, reported compactly ---------------------------------------------

class KeyReport:
    """The keys a replica reports: prefixes donated to its prefix cache, kept while the cache still
    holds their pages. ``add`` labels a donation by ``Keys.tag()``; ``snapshot(live)`` takes the live
    pages per tag (from the prefix cache's chain list) and keeps, of each donation, the keys its live
    pages still cover (the cache evicts a chain's leaves before its root)."""

    def __init__(self, max_keys: int = 4096):
        self.max_keys = max_keys
        self._by_tag: "collections.OrderedDict[str, Keys]" = collections.OrderedDict()
        self._seen: set = set()  # tags a snapshot found live

    def add(self, keys: Keys, tag: Optional[str] = None) -> str:
        tag = tag or keys.tag()
        if tag:
            self._by_tag[tag] = keys
            self._by_tag.move_to_end(tag)
            while len(self._by_tag) > self.max_keys:
                self._seen.discard(self._by_tag.popitem(last=False)[0])
        return tag

    def snapshot(self, live: Optional[Dict[str, float]] = None) -> List[int]:
        """Keys still cached, newest donations first, at most ``max_keys``. ``live``: tag -> fraction
        of the donation's pages still cached (None: trust every donation)."""
        out: List[int] = []
        seen = set()
        for tag in reversed(self._by_tag):
            frac = 1.0 if live is None else live.get(tag, 0.0)
            if frac <= 0.0:
                continue
            k = self._by_tag[tag]
            limit = k.total * frac
            for key, w in zip(k.keys, k.weights):
                if w > limit + 1e-9:
                    break
                if key not in seen:
                    seen.add(key)
                    out.append(key)
            if len(out) >= self.max_keys:
                break
        if live is not None:
            # Forget donations the cache held and has let go of; one not seen yet (a request between its
            # reply and its donation) waits for the next snapshot, or for max_keys to push it out.
            for tag in [t for t in self._by_tag if live.get(t, 0.0) <= 0.0 and t in self._seen]:
                del self._by_tag[tag]
                self._seen.discard(tag)
            self._seen |= {t for t in self._by_tag if live.get(t, 0.0) > 0.0}
        return out[:self.max_keys]


# ---- router side: the decision -----------------------------------------------------------------------------

class AffinityPolicy:
    """Route to the replica holding the longest prefix of a request's keys, weighed against its load,
    unless its load (requests in flight there) is past ``max_load``; then, or with no match, to the
    least-loaded replica (ties: the one reporting the fewest keys, i.e. the emptiest cache).

    A replica scores its matched weight (below ``min_match`` counts as none) less ``load_cost`` per
    request in flight: a prefix every conversation shares (a system prompt) wins only while its holder
    is not much busier than the others, so it spreads to more replicas instead of piling onto one,
    while a conversation's own history (long, held by one replica) keeps its turns together.

    What a replica holds is its last report (``report``) plus where this router sent requests in the
    last ``memory_s`` seconds (``note_routed``), which covers the time until the next report.
    """

    def __init__(self, max_load: int = 8, load_cost: int = 512, min_match: int = 1, memory_s: float = 10.0,
                 memory_keys: int = 200_000, clock=time.monotonic):
        self.max_load = max_load
        self.load_cost = load_cost
        self.min_match = min_match
        self.memory_s = memory_s
        self.memory_keys = memory_keys
        self.clock = clock
        self._reported: Dict[Hashable, frozenset] = {}
        self._recent: "collections.OrderedDict[int, Tuple[Hashable, float]]" = collections.OrderedDict()
        self._rr = 0

    def report(self, replica: Hashable, keys: Iterable[int]) -> None:
        self._reported[replica] = frozenset(keys)

    def forget(self, replica: Hashable) -> None:
        """A replica is gone (died, scaled down): its cache went with it."""
        self._reported.pop(replica, None)
        for k in [k for k, (r, _) in self._recent.items() if r == replica]:
            del self._recent[k]

    def note_routed(self, replica: Hashable, keys: Keys) -> None:
        now = self.clock()
        for k in keys.keys:
            self._recent[k] = (replica, now)
            self._recent.move_to_end(k)
        while len(self._recent) > self.memory_keys:
            self._recent.popitem(last=False)

    def matched(self, replica: Hashable, keys: Keys) -> int:
        """The weight of the longest prefix of ``keys`` this replica is believed to hold."""
        held = self._reported.get(replica, frozenset())
        now = self.clock()
        for i in range(len(keys.keys) - 1, -1, -1):
            k = keys.keys[i]
            if k in held:
                return keys.weights[i]
            r = self._recent.get(k)
            if r is not None and r[0] == replica and now - r[1] <= self.memory_s:
                return keys.weights[i]
        return 0

    def _order(self, loads: Dict[Hashable, int]) -> List[Hashable]:
        ids = list(loads)
        self._rr += 1
        # Rotate the start so exact ties spread instead of piling on the first replica.
        return ids[self._rr % len(ids):] + ids[:self._rr % len(ids)]

    def least_loaded(self, loads: Dict[Hashable, int]) -> Hashable:
        return min(self._order(loads), key=lambda r: (loads[r], len(self._reported.get(r, ()))))

    def choose(self, keys: Keys, loads: Dict[Hashable, int]) -> Hashable:
        """The replica for a request with ``keys``; ``loads``: replica -> requests in flight there."""
        if not loads:
            raise ValueError("no replicas to choose from")
        best, best_score = None, None
        for r in self._order(loads):
            w = self.matched(r, keys) if keys.keys else 0
            score = (w if w >= self.min_match else 0) - self.load_cost * loads[r]
            tie = (score, -loads[r], -len(self._reported.get(r, ())))
            if best_score is None or tie > best_score:
                best, best_score = r, tie
        if loads[best] <= self.max_load:
            return best
        return self.least_loaded(loads)

    def rank(self, keys: Keys, loads: Dict[Hashable, int]) -> List[Hashable]:
        """Every replica, the chosen one first, then by load: fallbacks when the first refuses."""
        first = self.choose(keys, loads)
        return [first] + sorted((r for r in loads if r != first), key=lambda r: loads[r])


def encode_keys(keys: Sequence[int]) -> str:
    """A key list as compact text (8 bytes a key, base64), for reports that travel as JSON."""
    return base64.b64encode(b"".join(int(k).to_bytes(8, "little") for k in keys)).decode()


def decode_keys(s: str) -> List[int]:
    raw = base64.b64decode(s)
    return [int.from_bytes(raw[i:i + 8], "little") for i in range(0, len(raw), 8)]
