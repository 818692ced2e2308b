"""featcache: activation caches from pretrained backbones in chunked HDF5 stores."""

from featcache._compat import ensure_torchvision_importable

ensure_torchvision_importable()  # before any featcache module imports torchvision

__version__ = "0.1.0"
