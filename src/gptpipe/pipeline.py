"""config.yaml as one typed object: a section per stage that reads it."""

from __future__ import annotations

from dataclasses import dataclass

from gptpipe.config.core import option
from gptpipe.corpus.config import CorpusConfig
from gptpipe.data.config import DataConfig, TokenizeConfig
from gptpipe.storage import StorageConfig
from gptpipe.runtime.config import LoggingConfig, ModelConfig
from gptpipe.train.config import TrainConfig


@dataclass
class PipelineConfig:
    """config.yaml: stage 0 (corpus), stage 2 (tokenize), stage 3 (data, model, train, logging)."""

    corpus: CorpusConfig = option(factory=CorpusConfig, doc="stage 0")
    tokenize: TokenizeConfig = option(factory=TokenizeConfig, doc="stage 2")
    data: DataConfig = option(factory=DataConfig, doc="stage 3 data")
    model: ModelConfig = option(factory=ModelConfig, doc="stage 3 model")
    train: TrainConfig = option(factory=TrainConfig, doc="stage 3 schedule and engine")
    logging: LoggingConfig = option(factory=LoggingConfig, doc="stage 3 logging")
    storage: StorageConfig = option(factory=StorageConfig, doc="object storage (bucket URLs in any section)")

    def check(self) -> list[tuple[str, str]]:
        """Cross-section defaults: the schedule follows whether training starts from a base model."""
        return [(f"train.{key}", message)
                for key, message in self.train.resolve_schedule(continued=self.model.init_from is not None)]
