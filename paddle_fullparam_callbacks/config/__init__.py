"""Layer 1: the structured config and recipe loading."""
from .recipes import coerce_config, list_recipes, load_config, recipes_dir, resolve_recipe, to_yaml
from .schema import ConfigError, ExportConfig, FullParamConfig, RetentionConfig, TopologyConfig, TriggerConfig
from .sizes import format_size, parse_size

__all__ = [
    "ConfigError", "ExportConfig", "FullParamConfig", "RetentionConfig", "TopologyConfig", "TriggerConfig",
    "coerce_config", "format_size", "list_recipes", "load_config", "parse_size", "recipes_dir",
    "resolve_recipe", "to_yaml",
]
