"""The resources a pod opens at start-up and hands to every handler."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cachestore.store import BlockStore
from service.cache.pipeline import Pipeline
from service.cache.writer import BackgroundWriter
from service.engines import Engine
from service.http.admission import Admission
from service.runtime.drain import Drain
from service.runtime.metrics import PodMetrics
from service.settings import PodSettings


@dataclass
class PodState:
    settings: PodSettings
    metrics: PodMetrics
    engine: Engine | None = None
    store: BlockStore | None = None
    writer: BackgroundWriter | None = None
    pipeline: Pipeline | None = None
    admission: Admission = field(init=False)  # the bound on requests in flight
    drain: Drain = field(default_factory=Drain)  # begun by SIGTERM (service.runtime.drain): the pod is then not ready
    started_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.admission = Admission(self.settings.max_queue, self.metrics)

    @property
    def ready(self) -> bool:
        return self.pipeline is not None
