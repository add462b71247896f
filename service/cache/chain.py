"""Chain roots: the parent of each tenant's first block, and the chained hashes of a sequence's full blocks."""

from __future__ import annotations

from cachestore.hashing import BlockHash, ModelFingerprint, chain_hashes, root_hash


class Chain:
    """The hash chain of one pod's model (its fingerprint) and block size; roots are kept per tenant salt."""

    def __init__(self, fingerprint: ModelFingerprint, block_tokens: int) -> None:
        self.fingerprint = fingerprint
        self.block_tokens = block_tokens
        self._roots: dict[str, BlockHash] = {}

    def root(self, tenant_salt: bytes) -> BlockHash:
        """The parent of the tenant's first block (and the key of a tail shorter than one block)."""
        root = self._roots.get(tenant_salt.hex())
        if root is None:
            root = self._roots.setdefault(tenant_salt.hex(), root_hash(self.fingerprint, tenant_salt))
        return root

    def hashes(self, tenant_salt: bytes, token_ids: list[int]) -> list[BlockHash]:
        """The hashes of the full blocks of `token_ids`, each chained to the one before."""
        return chain_hashes(token_ids, self.block_tokens, self.root(tenant_salt))

    def parent(self, tenant_salt: bytes, hashes: list[BlockHash], blocks: int) -> BlockHash:
        """The key of the tokens after the first `blocks` of `hashes`: the last of those blocks' hash, else the root."""
        return hashes[blocks - 1] if blocks else self.root(tenant_salt)
