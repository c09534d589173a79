"""Typed, strict configuration: YAML (safe_load) → dataclasses, with key=value overrides."""

from gptpipe.config.core import ConfigError, describe, load_config, option, to_plain

__all__ = ["ConfigError", "describe", "load_config", "option", "to_plain"]
