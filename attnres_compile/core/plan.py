"""The plan that chain analysis returns and every rewriter applies (docs/design.md §2). Names are
the source format's node/value names, so a rewriter maps the plan onto its graph by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Link:
    """An n-ary residual sum: `result = skip + sum(branches)`, built from the add nodes `adds`
    (and `inner`, value-preserving ops between them, e.g. a p=0 dropout; removed with them)."""

    result: str
    skip: str
    branches: list[str]
    adds: list[str]
    shape: tuple
    inner: list[str] = field(default_factory=list)


@dataclass
class Chain:
    """Links L_1..L_n where the skip of L_(k+1) is (a passthrough of) the result of L_k."""

    index: int
    links: list[Link]
    feature_axis: int
    feature_size: int | str | None
    rewrite: bool = False
    reason: str | None = None
    changes_function: bool = False
    through: list[str] = field(default_factory=list)  # non-linear ops between links (opt-in only)
    # per link, the ops between the previous link's result and this link's skip, from the result's side
    # (casts, views: [] for the first link and where the skip is the result itself); Delta keeps them on
    # the plain sum and gives their other readers the same ops over the site's Delta output
    skip_paths: list[list[str]] = field(default_factory=list)

    @property
    def root(self) -> str:
        """v_0: the skip operand of the first link."""
        return self.links[0].skip

    @property
    def sources(self) -> list[str]:
        """[v_0, v_1, ..., v_m]: the root, then every branch output in graph order."""
        return [self.root] + [b for link in self.links for b in link.branches]

    @property
    def sites(self) -> list[str]:
        return [link.result for link in self.links]

    def site_terms(self, block_size: int) -> list[list[tuple[int, ...]]]:
        """For each site k, S_k as source-index groups: (0,) is v_0, a longer tuple a block sum of
        consecutive sources up to site k (block_size 1 gives Full AttnRes).
        """
        terms, seen = [], 0
        for link in self.links:
            seen += len(link.branches)
            groups = [(0,)]
            for start in range(1, seen + 1, block_size):
                groups.append(tuple(range(start, min(start + block_size, seen + 1))))
            terms.append(groups)
        return terms


@dataclass
class RewrittenSite:
    """What a rewriter made of site `site` (from 1) of chain `chain`: its node and query name."""

    chain: int
    site: int
    node: str
    param: str
    num_terms: int
    scale: float
    gate: str | None = None  # Delta AttnRes: the site's gate parameter


@dataclass
class SkippedAdd:
    node: str
    target: str
    reason: str


@dataclass
class Plan:
    chains: list[Chain]
    skipped_adds: list[SkippedAdd]
    existing_sites: list[str]  # depth_attention nodes already in the graph
    adds_total: int

    @property
    def to_rewrite(self) -> list[Chain]:
        return [c for c in self.chains if c.rewrite]
