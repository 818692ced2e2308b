"""The parquet source over real CIFAR-10 JPEGs stored as image bytes in Parquet files."""

from __future__ import annotations

import io
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

import featcache
from featcache.config.spec import DataSpec
from featcache.errors import ConfigError, FeatcacheError
from featcache.sources import build_source
from tests.cifar_formats import (
    CLASSES,
    WordLengths,
    assert_same_as_imagefolder,
    config,
    extract_images,
    write_parquet,
)

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


@pytest.fixture(scope="module")
def cifar(tmp_path_factory) -> tuple[Path, list]:
    """Images in a folder, the same images in one Parquet file, the imagefolder store."""
    root = tmp_path_factory.mktemp("cifar")
    rows = extract_images(root / "images")
    write_parquet(rows, root / "train.parquet")
    data = {"source": "imagefolder", "root": str(root), "splits": {"train": "images"}}
    featcache.extract_from_config(config(data, root / "reference"))
    return root, rows


def test_same_features_labels_and_order_as_imagefolder(cifar, tmp_path):
    root, _ = cifar
    data = {
        "source": "parquet",
        "root": str(root),
        "splits": {"train": "train.parquet"},
        "id_column": "id",
    }
    loader = {"batch_size": 16, "num_workers": 2}  # 32-row groups: batches straddle them
    store = featcache.extract_from_config(config(data, tmp_path / "out", loader=loader))["train"]
    assert store.complete and store.class_names == list(CLASSES)  # names sorted = CIFAR order
    assert_same_as_imagefolder(store.path, root / "reference" / "train.h5")


def test_several_files_default_ids_and_pickling(cifar, tmp_path):
    _, rows = cifar
    write_parquet(rows[:70], tmp_path / "part-0.parquet", row_group_size=16)
    write_parquet(rows[70:], tmp_path / "part-1.parquet", row_group_size=50)
    glob = DataSpec(source="parquet", root=str(tmp_path), splits={"t": "part-*.parquet"})
    braces = DataSpec(source="parquet", root=str(tmp_path), splits={"t": ["part-{0,1}.parquet"]})
    source = build_source(glob, "t", None)
    assert len(source) == 200 and source.ids[69:71] == ["part-0.parquet:69", "part-1.parquet:0"]
    assert build_source(braces, "t", None).fingerprint() == source.fingerprint()
    assert source.fingerprint(content=True) != source.fingerprint()
    copy = pickle.loads(pickle.dumps(source))
    assert len(pickle.dumps(source)) < 20_000
    for i in (0, 15, 16, 69, 70, 119, 120, 199, 3):  # across groups and files, and back
        image, label = copy[i]
        assert label == rows[i][1] and image.size == (32, 32)
    source.decode_size = 16
    assert source[0][0].size == (16, 16)


def test_hf_style_struct_images_classlabel_names_and_paths(cifar, tmp_path):
    root, rows = cifar
    struct = pa.array(
        [{"bytes": r[2], "path": None} for r in rows[:5]],
        type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
    )
    meta = b'{"info": {"features": {"label": {"names": ["x", "y"], "_type": "ClassLabel"}}}}'
    table = pa.table({"image": struct, "label": [0, 1, 1, 0, 1]}).replace_schema_metadata(
        {"huggingface": meta}
    )
    pq.write_table(table, tmp_path / "hf.parquet")
    source = build_source(
        DataSpec(source="parquet", root=str(tmp_path), splits={"t": "hf.parquet"}), "t", None
    )
    assert source.class_names == ["x", "y"] and [source[i][1] for i in range(5)] == [0, 1, 1, 0, 1]
    paths = pa.table({"file": [f"images/{r[0]}" for r in rows[:4]], "cls": [3, 1, 4, 1]})
    pq.write_table(paths, root / "paths.parquet")
    data = DataSpec(
        source="parquet",
        root=str(root),
        image_column="file",
        label_column="cls",
        splits={"t": "paths.parquet"},
    )
    by_path = build_source(data, "t", None)
    assert by_path.class_names is None and by_path[2][1] == 4 and by_path[2][0].size == (32, 32)


def test_missing_columns_bad_files_and_bad_images(cifar, tmp_path):
    root, rows = cifar
    data = DataSpec(
        source="parquet", root=str(root), label_column="class", splits={"t": "train.parquet"}
    )
    with pytest.raises(
        ConfigError,
        match=r"data.label_column 'class' is not a column of train.parquet; "
        "its columns: id, image, label",
    ):
        build_source(data, "t", None)
    pq.write_table(pa.table({"n": [1, 2]}), tmp_path / "numbers.parquet")
    with pytest.raises(
        ConfigError,
        match=r"no column of numbers.parquet holds image bytes; set data.image_column "
        r".*its columns: n \(int64\)",
    ):
        build_source(
            DataSpec(source="parquet", root=str(tmp_path), splits={"t": "numbers.parquet"}),
            "t",
            None,
        )
    (tmp_path / "fake.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match="fake.parquet cannot be read as a Parquet file"):
        build_source(
            DataSpec(source="parquet", root=str(tmp_path), splits={"t": "fake.parquet"}), "t", None
        )
    pq.write_table(pa.table({"image": [rows[0][2], b"garbage"]}), tmp_path / "bad.parquet")
    source = build_source(
        DataSpec(source="parquet", root=str(tmp_path), splits={"t": "bad.parquet"}), "t", None
    )
    assert not source.has_labels and source[0][1] == -1
    with pytest.raises(
        FeatcacheError, match=r"cannot decode image bad.parquet:1 \(bad.parquet row 1\)"
    ):
        source[1]
    with pytest.raises(
        ConfigError, match="differ: .*bad.parquet has columns image but numbers.parquet has n"
    ):
        build_source(
            DataSpec(
                source="parquet",
                root=str(tmp_path),
                splits={"t": ["bad.parquet", "numbers.parquet"]},
            ),
            "t",
            None,
        )


def test_a_text_column_makes_a_text_source(tmp_path):
    texts = ["a bb ccc", "dddd", "one two three four five six seven eight nine"]
    pq.write_table(pa.table({"t": texts, "label": ["x", "y", "x"]}), tmp_path / "t.parquet")
    data = DataSpec(
        source="parquet", root=str(tmp_path), text_column="t", splits={"s": "t.parquet"}
    )
    source = build_source(data, "s", None, tokenizer=WordLengths())
    assert len(source) == 3 and source.class_names == ["x", "y"]
    tokens, label = source[0]
    assert tokens["input_ids"].tolist() == [2, 3, 4] and label == 0
    assert len(source[2][0]["input_ids"]) == 8  # the tokenizer's own limit
    with pytest.raises(ConfigError, match="text_column is set but the model has no tokenizer"):
        build_source(data, "s", None)


def test_reads_in_a_fresh_interpreter_where_nothing_imported_pyarrow_parquet(tmp_path):
    # `import pyarrow` leaves out its parquet submodule: featcache must import it itself.
    images = []
    for shade in range(3):
        buffer = io.BytesIO()
        Image.new("RGB", (8, 8), (shade * 80, 0, 0)).save(buffer, format="PNG")
        images.append(buffer.getvalue())
    pq.write_table(pa.table({"image": images, "label": [0, 1, 1]}), tmp_path / "t.parquet")
    code = (
        "import sys\n"
        "from featcache.sources import build_source\n"
        "from featcache.config.spec import DataSpec\n"
        f"data = DataSpec(source='parquet', root={str(tmp_path)!r}, splits={{'t': 't.parquet'}})\n"
        "source = build_source(data, 't', None)\n"
        "image, label = source[2]\n"
        "print(len(source), image.size, label, 'pyarrow.parquet' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "(8,", "8)", "1", "True"]
