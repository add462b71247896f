"""A block read from a Redis Cluster: every node's share at once, each on a connection of its own node, values landing
in the caller's buffers; keys whose slot moved are read again through the Cluster client."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from cachestore.store.reads import Keyed, ReadParts
from cachestore.wire import Target, pipelined_into

REDIRECTS = ("MOVED ", "ASK ")  # a Cluster node's answer for a slot it no longer serves (or is handing over)


def _redirected(reply: Any) -> bool:
    return isinstance(reply, ResponseError) and str(reply).startswith(REDIRECTS)


class NodeReads(ReadParts):
    """Reads of a Cluster by node."""

    def _fetch_by_node(self, client: Any, keyed: Keyed, start: int, into: Sequence[Target]) -> list[Any]:
        """The replies `_queue_fetch` would give, from a Cluster: each node's keys (and their shards' LRU touches) in
        one round trip on a connection of that node, every node at once, each value received into its buffer. A key
        whose slot moved or is moving (MOVED, ASK), or whose node did not answer, is read again through the Cluster
        client, which follows the redirection, fails over and learns the new slot map."""
        self._counters.add("round_trips")
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i, (_, key) in enumerate(keyed):
            node = client.get_node_from_key(key)
            groups.setdefault(node.name, (node, []))[1].append(i)
        shares = list(groups.values())
        assert self._node_readers is not None
        others: list[Future[tuple[list[int], list[int], list[Any] | None]]] = [
            self._node_readers.submit(self._read_node, client, node, keyed, indices, start, into)
            for node, indices in shares[1:]]
        try:
            answered = [self._read_node(client, shares[0][0], keyed, shares[0][1], start, into)]
        finally:
            answered += [f.result() for f in others]  # every node's connection is back in its pool before a retry
        replies: list[Any] = [None] * len(keyed)
        touched: list[Any] = []
        moved: list[int] = []
        for indices, shards, got in answered:
            if got is None:  # the node did not answer: the Cluster client finds out why (a failover?)
                moved += indices
                continue
            for i, reply in zip(indices, got, strict=False):
                replies[i] = reply
                if _redirected(reply):
                    moved.append(i)
            for shard, reply in zip(shards, got[len(indices):], strict=False):
                if _redirected(reply):
                    moved += [i for i in indices if keyed[i][0] == shard and i not in moved]
                else:
                    touched.append(reply)
        if moved:
            self._read_again(client, keyed, start, sorted(set(moved)), replies)
        return replies + touched

    def _read_again(self, client: Any, keyed: Keyed, start: int, again: list[int], replies: list[Any]) -> None:
        """Read the keys at `again` through the Cluster client, into `replies`."""
        self._counters.add_all(redirects=len(again), round_trips=1)
        # without their LRU touches: a script over a slot's keys while they migrate is refused (TRYAGAIN), and
        # redis-py retries that with pauses for a second or more; the next read touches them
        pipe = client.pipeline(transaction=False)
        for i in again:
            if i < start:
                pipe.pexpire(keyed[i][1], self._block_ttl_ms)
            else:
                pipe.getex(keyed[i][1], px=self._block_ttl_ms)
        for i, reply in zip(again, pipe.execute(raise_on_error=False), strict=False):
            replies[i] = reply

    def _read_node(
        self, client: Any, node: Any, keyed: Keyed, indices: list[int], start: int, into: Sequence[Target],
    ) -> tuple[list[int], list[int], list[Any] | None]:
        """One node's share of `_fetch_by_node`: its keys' indices, the shards whose touches follow their replies,
        and the replies (a value of its buffer's length received into it); None when the node did not answer."""
        share = [keyed[i] for i in indices]  # in order: the locally held ones (PEXPIRE) come first, as in keyed
        held = sum(1 for i in indices if i < start)
        server = client.get_redis_connection(node)
        pipe = server.pipeline(transaction=False)
        self._queue_fetch(pipe, share, held, count=False)
        commands, targets = self._landing_request(pipe, share, held, [into[i] for i in indices])
        shards = list(dict.fromkeys(shard for shard, _ in share)) if self.settings.budget_enabled else []
        try:
            return indices, shards, pipelined_into(server, commands, targets)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            return indices, shards, None
