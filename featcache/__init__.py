"""featcache: activation caches from pretrained backbones in chunked HDF5 stores."""

from featcache._compat import ensure_torchvision_importable

ensure_torchvision_importable()  # before any featcache module imports torchvision

__version__ = "0.1.0"

from featcache.dataset import FeatureDataset, ShuffledBatches  # noqa: E402
from featcache.errors import ConfigError, FeatcacheError  # noqa: E402
from featcache.pipeline import extract, extract_from_config  # noqa: E402
from featcache.store import FeatureStore  # noqa: E402

__all__ = [
    "ConfigError",
    "FeatcacheError",
    "FeatureDataset",
    "FeatureStore",
    "ShuffledBatches",
    "extract",
    "extract_from_config",
]
