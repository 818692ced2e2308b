"""Image files are decoded in full by default; ``loader.decode: fast`` is recorded and verified."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

import featcache
from featcache.commands.verify import verify_store
from featcache.config.spec import load_config, to_dict
from featcache.store.provenance import config_fingerprint, content_config, recorded_config


def _photos(tmp_path: Path, hymenoptera_root: Path) -> list[Path]:
    """Six real photos (shorter sides far above 2 x 36 px) in an ImageFolder split."""
    folder = tmp_path / "photos" / "val" / "bees"
    folder.mkdir(parents=True)
    photos = sorted((hymenoptera_root / "val" / "bees").glob("*.jpg"))[:6]
    for photo in photos:
        shutil.copy(photo, folder / photo.name)
    return sorted(folder.iterdir())


def _config(tmp_path: Path, out: str, decode: str | None = None) -> dict:
    config = {
        "model": {"name": "resnet18"},
        "layers": [{"name": "layer2", "reduce": "avg"}],
        "data": {"source": "imagefolder", "root": str(tmp_path / "photos"), "splits": ["val"]},
        "preprocess": {"resize": 36, "crop": 32},
        "loader": {"batch_size": 3, "num_workers": 0},
        "store": {"dtype": "float32"},
        "output": {"dir": str(tmp_path / out)},
        "runtime": {"progress": False, "device": "cpu"},
    }
    if decode is not None:
        config["loader"]["decode"] = decode
    return config


def test_photos_are_decoded_in_full_unless_fast_is_asked(tmp_path, hymenoptera_root):
    import torchvision

    files = _photos(tmp_path, hymenoptera_root)
    exact = featcache.extract_from_config(_config(tmp_path, "exact"))["val"]
    fast = featcache.extract_from_config(_config(tmp_path, "fast", "fast"))["val"]
    assert exact.config["loader"]["decode"] == "exact"
    assert fast.config["loader"]["decode"] == "fast"

    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    transform = featcache.models.build_transform(
        featcache.config.spec.PreprocessSpec(resize=36, crop=32)
    )
    batch = torch.stack([transform(Image.open(path).convert("RGB")) for path in files])
    pooled: list[torch.Tensor] = []
    model.layer2.register_forward_hook(lambda m, a, out: pooled.append(out.mean((2, 3))))
    with torch.no_grad():
        model(batch)
    torch.testing.assert_close(exact.read("layer2"), pooled[0], atol=1e-5, rtol=1e-5)
    change = (fast.read("layer2") - pooled[0]).norm(dim=1) / pooled[0].norm(dim=1)
    assert float(change.median()) > 1e-3  # other pixels, other features


def test_verify_recomputes_with_the_recorded_decoding(tmp_path, hymenoptera_root):
    _photos(tmp_path, hymenoptera_root)
    store = featcache.extract_from_config(_config(tmp_path, "fast", "fast"))["val"]
    result = verify_store(store.path, samples=-1)
    assert result.passed, [check for check in result.checks if not check.ok]


def test_configs_recorded_before_the_option_existed_read_as_decoded_fast():
    """Older stores decoded JPEGs at reduced scale: their recorded configs read so, and
    keep the fingerprint they were written with; a new config's default differs."""
    config = _config(Path("/data"), "out")
    older = to_dict(load_config(config))
    del older["loader"]["decode"]
    written_with = hashlib.sha256(
        json.dumps(content_config(older), sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    as_recorded = load_config(recorded_config(older))
    assert as_recorded.loader.decode == "fast"
    assert config_fingerprint(as_recorded) == written_with
    assert config_fingerprint(load_config(config)) != written_with


@pytest.mark.parametrize("value", ["draft", "full"])
def test_an_unknown_decode_is_one_config_error(value):
    with pytest.raises(featcache.errors.ConfigError, match="loader.decode"):
        load_config(_config(Path("/data"), "out", value))
