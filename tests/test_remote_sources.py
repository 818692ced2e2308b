"""Sources read from object stores and HTTP through fsspec: moto's S3 and an HTTP server
on 127.0.0.1, against stores made from local copies of the same files (real CIFAR-10
JPEGs), with requests counted and faults injected."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

import featcache
from featcache.config.spec import DataSpec, load_config
from featcache.errors import ConfigError, FeatcacheError, FeatcacheWarning
from featcache.sources import build_source
from featcache.store import FeatureStore
from tests.cifar_formats import (
    CLASSES,
    assert_same_as_imagefolder,
    config,
    extract_images,
    killed_mid_run,
    write_parquet,
    write_shards,
)
from tests.object_servers import (
    ACCESS_KEY,
    BUCKET,
    SECRET_KEY,
    Faults,
    ObjectServer,
    moto_s3,
    s3,
    serving,
    upload,
)

pytest.importorskip("s3fs")
pytest.importorskip("moto")
pytest.importorskip("pyarrow")

REPO = Path(__file__).resolve().parents[1]
SHARDS = "shards/train-{000000..000002}.tar"
LOADER = {"batch_size": 4, "num_workers": 0}
pytestmark = pytest.mark.usefixtures("index_cache")


@pytest.fixture(scope="module")
def cifar(tmp_path_factory) -> Path:
    """20 CIFAR-10 JPEGs as an image folder, 3 shards, a Parquet file and a manifest,
    and the store of each made from these local files."""
    root = tmp_path_factory.mktemp("cifar")
    rows = extract_images(root / "images", per_class=2)
    write_shards(rows, root / "shards", shards=3)
    write_parquet(rows, root / "train.parquet", row_group_size=6)
    (root / "train.csv").write_text(
        "path,label\n" + "".join(f"images/{i},{CLASSES[label]}\n" for i, label, _ in rows)
    )
    for name in FORMATS:
        data = data_under(name, str(root))
        featcache.extract_from_config(config(data, root / "reference" / name, loader=LOADER))
    return root


# The data section of every format, without its root.
FORMATS: dict[str, dict[str, Any]] = {
    "webdataset": {"source": "webdataset", "splits": {"train": SHARDS}},
    "parquet": {"source": "parquet", "id_column": "id", "splits": {"train": "train.parquet"}},
    "manifest": {"source": "manifest", "splits": {"train": "train.csv"}},
    "imagefolder": {"source": "imagefolder", "splits": {"train": "images"}},
}


def data_under(name: str, root: str, **options: Any) -> dict[str, Any]:
    """Format ``name``'s data section reading the files under ``root`` (a folder or URL)."""
    return {**FORMATS[name], "root": root, **options}


@pytest.fixture(scope="module")
def s3_server(cifar) -> Any:
    """moto's S3 on 127.0.0.1 holding the files of ``cifar`` under s3://data/cifar."""
    with moto_s3() as endpoint:
        upload(endpoint, cifar, "cifar")
        yield endpoint


@pytest.fixture
def proxy(s3_server) -> Any:
    """A counting HTTP server in front of the S3 server (featcache's endpoint)."""
    with serving(ObjectServer(upstream=s3_server)) as server:
        yield server


@pytest.fixture(scope="module")
def http_server(cifar) -> Any:
    """An HTTP server on 127.0.0.1 serving ``cifar``'s files (ranges, ETags)."""
    with serving(ObjectServer(folder=cifar)) as server:
        yield server


def s3_data(name: str, proxy: ObjectServer, **options: Any) -> dict[str, Any]:
    opts = {"endpoint_url": proxy.url}
    return data_under(name, f"s3://{BUCKET}/cifar", storage_options=opts, **options)


def reference(cifar: Path, name: str) -> Path:
    return cifar / "reference" / name / "train.h5"


@pytest.mark.parametrize("name", ["webdataset", "parquet", "manifest", "imagefolder"])
def test_a_store_from_s3_equals_the_store_from_local_files(cifar, proxy, tmp_path, name):
    # The source pickles into DataLoader workers (one case is enough to show it).
    loader = {"batch_size": 4, "num_workers": 2 if name == "webdataset" else 0}
    data = s3_data(name, proxy)
    store = featcache.extract_from_config(config(data, tmp_path / "s3", loader=loader))["train"]
    assert store.complete and len(store) == 20
    assert_same_as_imagefolder(store.path, reference(cifar, name))
    assert (
        store.attrs["dataset_fingerprint"]
        != FeatureStore(reference(cifar, name)).attrs["dataset_fingerprint"]
    )  # the remote one records the URLs and ETags
    gets = [r for r in proxy.requests if r.method == "GET" and "?" not in r.path]
    if name in ("webdataset", "parquet"):  # byte ranges only, never a whole object
        assert gets and all(r.range for r in gets)
    if name == "imagefolder":  # listed once: one listing of the folder, recursive
        listings = [r for r in proxy.requests if "list-type" in r.path]
        assert len(listings) == 1 and "prefix=cifar%2Fimages%2F" in listings[0].path


@pytest.mark.parametrize("name", ["webdataset", "parquet", "manifest"])
def test_a_store_over_http_equals_the_store_from_local_files(cifar, http_server, tmp_path, name):
    data = data_under(name, http_server.url)
    store = featcache.extract_from_config(config(data, tmp_path / "http", loader=LOADER))["train"]
    assert_same_as_imagefolder(store.path, reference(cifar, name))


def test_webdataset_shards_are_streamed_in_order_and_indexed_once(cifar, proxy, tmp_path):
    """The index reads each shard once from start to end; each batch is then one range
    request, in order, and no byte of a sample is read twice; a second run over the
    same shards reads no shard at all to index them."""
    data = s3_data("webdataset", proxy)
    featcache.extract_from_config(config(data, tmp_path / "a", loader=LOADER))
    source = build_source(DataSpec(**data), "train", None)
    for s, url in enumerate(source.shards):
        name = url.rsplit("/", 1)[1]
        reads = proxy.reads(name)
        assert reads[0].range is not None and reads[0].range.startswith("bytes=0-")  # index
        spans = [tuple(map(int, r.range.split("=")[1].split("-"))) for r in reads[1:]]
        if s == 0:  # the free-space check and the run's plan each look at the first
            first = (int(source.offset[0]), int(source.offset[0] + source.size[0] - 1))
            assert spans[:2] == [first, first]  # sample alone, before the batches
            del spans[:2]
        assert spans == sorted(spans)  # in order
        assert all(a[1] < b[0] for a, b in zip(spans, spans[1:], strict=False))  # disjoint
        rows = (source.shard == s).sum()
        assert len(spans) >= -(-rows // LOADER["batch_size"])  # one per batch (+ checks)
    proxy.requests.clear()
    featcache.extract_from_config(config(data, tmp_path / "b", loader=LOADER))
    assert not any(r.range and r.range.startswith("bytes=0-") for r in proxy.requests)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["s3", "http"])
def test_dropped_connections_and_503s_are_retried_and_reported(cifar, s3_server, tmp_path, where):
    faults = Faults(unavailable=0.2, drop=0.2, seed=3)
    if where == "s3":
        server = ObjectServer(upstream=s3_server, faults=faults)
    else:
        server = ObjectServer(folder=cifar, faults=faults)
    with serving(server):
        root = f"s3://{BUCKET}/cifar" if where == "s3" else server.url
        options = {"storage_options": {"endpoint_url": server.url}} if where == "s3" else {}
        for name in ("webdataset", "parquet"):
            before = dict(faults.injected)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                store = featcache.extract_from_config(
                    config(data_under(name, root, **options), tmp_path / name, loader=LOADER)
                )["train"]
            assert_same_as_imagefolder(store.path, reference(cifar, name))
            injected = sum(faults.injected.values()) - sum(before.values())
            reported = [str(w.message) for w in caught if w.category is FeatcacheWarning]
            assert injected > 0, "the seed injected no fault: pick another"
            assert len(reported) == 1 and f"{injected} remote reads were retried" in reported[0]


def test_a_missing_object_or_denied_access_is_one_line_naming_it(cifar, s3_server, tmp_path):
    faults = Faults(forbidden=("train-000001.tar",))
    with serving(ObjectServer(upstream=s3_server, faults=faults)) as server:
        options = {"endpoint_url": server.url}
        missing = data_under(
            "webdataset", f"s3://{BUCKET}/cifar", storage_options=options,
            splits={"train": "shards/train-{000002..000003}.tar"},
        )  # fmt: skip
        with pytest.raises(FeatcacheError) as info:
            featcache.extract_from_config(config(missing, tmp_path / "a"))
        message = str(info.value)
        assert f"s3://{BUCKET}/cifar/shards/train-000003.tar does not exist" in message
        denied = data_under("webdataset", f"s3://{BUCKET}/cifar", storage_options=options)
        with pytest.raises(FeatcacheError) as info:
            featcache.extract_from_config(config(denied, tmp_path / "b"))
        assert f"access to s3://{BUCKET}/cifar/shards/train-000001.tar was denied" in str(
            info.value
        )
        for error in (message, str(info.value)):
            assert "\n" not in error and ACCESS_KEY not in error and SECRET_KEY not in error


@pytest.mark.slow
def test_kill_and_resume_reads_no_finished_shard_again(cifar, proxy, tmp_path):
    model = {"factory": "tests.cifar_formats:slow_resnet18", "kwargs": {"delay": 0.3}}
    data = s3_data("webdataset", proxy)
    path = tmp_path / "killed.yaml"
    chunks = {"chunk_rows": 4}  # a progress mark at every batch
    run = config(data, tmp_path / "out", model=model, loader=LOADER, store=chunks)
    path.write_text(yaml.safe_dump(run))
    store = tmp_path / "out" / "train.h5"
    durable = killed_mid_run(path, store, 8, REPO)
    source = build_source(DataSpec(**data), "train", None)
    ends = [*source.shard_starts, len(source)]
    finished = [s for s, end in enumerate(ends) if end <= durable]
    assert finished and durable < 20
    proxy.requests.clear()
    featcache.extract_from_config(path)  # the same command, resumed here
    assert_same_as_imagefolder(store, reference(cifar, "webdataset"))
    again = [r for s in finished for r in proxy.reads(source.shards[s].rsplit("/", 1)[1])]
    # No index read there; only the first sample (read by the free-space check and by the
    # plan) and the resume's check, which recomputes the first and the last durable batch.
    assert len(again) <= 4 and not any(r.range.startswith("bytes=0-") for r in again)
    assert sum(r.sent for r in again) <= 3 * 4 * 2000  # three batches of small JPEGs
    unfinished = source.shards[finished[-1] + 1].rsplit("/", 1)[1]
    assert proxy.reads(unfinished)


def test_credentials_never_appear_in_a_store_an_output_or_an_error(cifar, proxy, tmp_path):
    from typer.testing import CliRunner

    from featcache.commands.app import app

    runner = CliRunner()
    data = s3_data("webdataset", proxy)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config(data, tmp_path / "out", loader=LOADER)))
    run = runner.invoke(app, ["--debug", "extract", str(path)])
    assert run.exit_code == 0, run.output
    denied = {**data, "storage_options": {"endpoint_url": proxy.url + "/nowhere"}}
    path.write_text(yaml.safe_dump(config(denied, tmp_path / "failed", loader=LOADER)))
    failed = runner.invoke(app, ["--debug", "extract", str(path)])
    assert failed.exit_code != 0
    verified = runner.invoke(app, ["verify", str(tmp_path / "out" / "train.h5")])
    assert verified.exit_code == 0, verified.output
    stored = (tmp_path / "out" / "train.h5").read_bytes()
    said = run.output + failed.output + verified.output
    for secret in (ACCESS_KEY, SECRET_KEY):
        assert secret.encode() not in stored and secret not in said
    with pytest.raises(ConfigError) as info:
        load_config(config({**data, "storage_options": {"secret": SECRET_KEY}}, tmp_path))
    assert "data.storage_options.secret would put a credential" in str(info.value)
    assert SECRET_KEY not in str(info.value)
    signed = f"https://h/x?X-Amz-Signature={SECRET_KEY}"
    for url in (f"s3://{ACCESS_KEY}:{SECRET_KEY}@{BUCKET}/x", signed):
        with pytest.raises(ConfigError, match="carries") as info:
            load_config(config({**data, "root": url}, tmp_path))
        assert SECRET_KEY not in str(info.value)


def test_verify_rereads_from_the_url_and_sees_a_replaced_object(cifar, s3_server, proxy, tmp_path):
    from featcache.commands.verify import verify_store

    data = s3_data("webdataset", proxy)
    store = featcache.extract_from_config(config(data, tmp_path / "out", loader=LOADER))["train"]
    proxy.requests.clear()
    result = verify_store(store.path, samples=4)
    assert result.passed, [c for c in result.checks if not c.ok]
    assert sum(len(proxy.reads(url.rsplit("/", 1)[1])) for url in _shards(data)) >= 2
    # The same shard written again (a new object, another ETag): verify says so.
    fs = s3(s3_server)
    key = f"{BUCKET}/cifar/shards/train-000001.tar"
    fs.pipe(key, fs.cat(key) + b"\0" * 1024)
    result = verify_store(store.path, samples=4)
    failed = [c.name for c in result.checks if not c.ok]
    assert not result.passed and any("data" in name for name in failed), failed
    fs.pipe(key, (cifar / "shards" / "train-000001.tar").read_bytes())


def _shards(data: dict[str, Any]) -> list[str]:
    return build_source(DataSpec(**data), "train", None).shards


def test_gs_and_az_without_their_extras_name_the_extra(tmp_path):
    from featcache.sources.remote import Remote

    for url, extra, module in (
        ("gs://b/x.tar", "gcs", "gcsfs"),
        ("az://c/x.tar", "azure", "adlfs"),
    ):
        try:
            __import__(module)
            continue  # installed: nothing to name
        except ImportError:
            pass
        with pytest.raises(FeatcacheError) as info:
            Remote().read(url)
        assert str(info.value) == (
            f"{url.split(':')[0]}:// URLs need featcache[{extra}]; install it with: "
            f"pip install 'featcache[{extra}]'"
        )


def test_sources_that_read_local_files_only_refuse_urls(tmp_path):
    with pytest.raises(ConfigError, match="data.root is a URL, but data.source=torchvision"):
        load_config(
            config({"source": "torchvision", "dataset": "CIFAR10", "root": "s3://b/c"}, tmp_path)
        )


def test_text_files_and_class_names_over_http_read_as_local_ones(cifar, http_server):
    from tests.cifar_formats import WordLengths

    (cifar / "texts.csv").write_text("text,label\na small cat,cat\na big dog,dog\n")
    (cifar / "names.txt").write_text("cat\ndog\n")
    sources = [
        build_source(
            DataSpec(source="text", root=root, splits={"t": "texts.csv"}),
            "t",
            None,
            tokenizer=WordLengths(),
        )
        for root in (str(cifar), http_server.url)
    ]
    local, remote = sources
    assert remote.ids == local.ids and remote.class_names == local.class_names == ["cat", "dog"]
    assert [remote[i][0]["input_ids"].tolist() for i in range(2)] == [[2, 6, 4], [2, 4, 4]]
    assert remote.fingerprint() != local.fingerprint()  # it records the URL and its ETag
    data = DataSpec(
        **data_under("webdataset", http_server.url),
        class_names=f"{http_server.url}/names.txt",
    )
    with pytest.raises(ConfigError, match="names 2 classes, but the source has label"):
        build_source(data, "train", None)


def test_torchrun_ranks_read_disjoint_shards(cifar, proxy, tmp_path):
    """Each rank's block (as :func:`featcache.extraction.distributed.block` cuts it for torchrun)
    extracted on its own: the shards one rank reads, no other rank reads."""
    from featcache.extraction import extract
    from featcache.extraction.distributed import block
    from featcache.extraction.from_config import build_backbone_for, build_source_for

    spec = load_config(config(s3_data("webdataset", proxy), tmp_path, loader=LOADER))
    backbone = build_backbone_for(spec)
    source = build_source_for(spec, "train", backbone)
    read: list[set[str]] = []
    for rank in range(2):
        rows = block(len(source), 4, rank, 2, source.shard_starts)
        proxy.requests.clear()
        extract(
            backbone.model, source, spec.layers, tmp_path / f"rank{rank}.h5", rows=rows,
            batch_size=4, num_workers=0, progress=False, device="cpu",
        )  # fmt: skip
        read.append({r.path.rsplit("/", 1)[1] for r in proxy.requests if r.range})
    assert read[0] and read[1] and not read[0] & read[1]
    assert read[0] | read[1] == {url.rsplit("/", 1)[1] for url in source.shards}


def test_a_storage_option_the_filesystem_does_not_take_is_one_line_naming_where_it_goes(
    cifar, proxy, tmp_path
):
    """region_name is an option of the S3 client, not of s3fs: given beside endpoint_url
    it is refused in one line saying to put it under client_kwargs, where it works; a
    misspelt option is named with the close one. Neither leaves an output folder."""
    top = {"endpoint_url": proxy.url, "region_name": "eu-west-1"}
    data = data_under("manifest", f"s3://{BUCKET}/cifar", storage_options=top)
    with pytest.raises(ConfigError) as info:
        featcache.extract_from_config(config(data, tmp_path / "top", loader=LOADER))
    message = str(info.value)
    assert message.startswith("data.storage_options.region_name is an option of the S3 client")
    assert "data.storage_options.client_kwargs.region_name" in message and "\n" not in message
    assert not (tmp_path / "top").exists()
    misspelt = {"s3": {"endpoint_url": proxy.url, "profile_name": "research"}}
    data = data_under("manifest", f"s3://{BUCKET}/cifar", storage_options=misspelt)
    refused = r"storage_options\.s3\.profile_name is not an option .*did you mean profile\?"
    with pytest.raises(ConfigError, match=refused):
        featcache.extract_from_config(config(data, tmp_path / "misspelt", loader=LOADER))
    fixed = {"endpoint_url": proxy.url, "client_kwargs": {"region_name": "eu-west-1"}}
    data = data_under("manifest", f"s3://{BUCKET}/cifar", storage_options=fixed)
    store = featcache.extract_from_config(config(data, tmp_path / "fixed", loader=LOADER))
    assert_same_as_imagefolder(store["train"].path, reference(cifar, "manifest"))


def test_missing_credentials_say_where_they_are_read(cifar, proxy, tmp_path, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask
    data = s3_data("webdataset", proxy)
    with pytest.raises(FeatcacheError) as info:
        featcache.extract_from_config(config(data, tmp_path / "out", loader=LOADER))
    message = str(info.value)
    assert message.startswith(f"no credentials were found to read s3://{BUCKET}/cifar/")
    assert "Unable to locate credentials" in message and "\n" not in message
    for hint in ("AWS_ACCESS_KEY_ID", "data.storage_options.profile", "machine's role"):
        assert hint in message
