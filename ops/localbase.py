"""Stand-in images from Debian packages, for a machine that reaches no image registry (`make compose-check`).

The Dockerfiles and docker-compose.yml name public images (python:3.11-slim-bookworm, redis, nginx, Prometheus,
redis_exporter, Grafana). Where `docker pull` cannot reach a registry, `ensure` makes a stand-in under the same
name instead: a Debian bookworm root file system (debootstrap, from the apt mirror this machine uses) imported as
`debian:bookworm-slim`, and on it the Debian package of each service. Stand-ins are labelled
`org.kvstash.standin` with the package they hold, so `compose-check` can say what it really ran. An image that has
neither a registry nor a Debian package (Grafana) is reported missing; nothing pretends to be it.

`torch_index` does the same for the CPU torch wheel: where download.pytorch.org is out of reach, the wheel in this
machine's pip find-links is served to the builds as a one-package index (their TORCH_INDEX_URL).

This is only this machine's workaround: with a registry, `docker compose up --build` pulls the real images.

    python -m ops.localbase [IMAGE ...]      # make (or find) these images; all known ones by default
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

DEBIAN = "debian:bookworm-slim"
LABEL = "org.kvstash.standin"
TORCH = "torch==2.13.0"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
INDEX_PORT = 38517  # fixed, so the build argument (and with it docker's layer cache) is the same on every run

# image -> (Debian packages, the Dockerfile after its FROM and install: the interface the real image has)
STANDINS: dict[str, tuple[tuple[str, ...], str]] = {
    # the official image's python: /usr/local/bin/python and pip, headers for C extensions, pip free to install
    "python:3.11-slim-bookworm": (
        ("python3.11", "python3.11-dev", "python3-pip", "python3-venv", "ca-certificates"),
        "RUN rm -f /usr/lib/python3.11/EXTERNALLY-MANAGED && ln -s /usr/bin/python3.11 /usr/local/bin/python"
        " && ln -s /usr/bin/pip3 /usr/local/bin/pip\nENV LANG=C.UTF-8\nCMD [\"python3\"]\n",
    ),
    "redis:7.2-bookworm": (("redis-server", "redis-tools"), "WORKDIR /data\nEXPOSE 6379\nCMD [\"redis-server\"]\n"),
    "nginx:1.27-alpine": (
        ("nginx-light",),
        "RUN ln -sf /dev/stdout /var/log/nginx/access.log && ln -sf /dev/stderr /var/log/nginx/error.log\n"
        "EXPOSE 80\nSTOPSIGNAL SIGQUIT\nCMD [\"nginx\", \"-g\", \"daemon off;\"]\n",
    ),
    "prom/prometheus:v2.53.0": (
        ("prometheus",),
        "RUN mkdir -p /prometheus && chmod 777 /prometheus\nWORKDIR /prometheus\nEXPOSE 9090\n"
        "ENTRYPOINT [\"/usr/bin/prometheus\"]\n"
        "CMD [\"--config.file=/etc/prometheus/prometheus.yml\", \"--storage.tsdb.path=/prometheus\"]\n",
    ),
    "oliver006/redis_exporter:v1.62.0": (
        ("prometheus-redis-exporter",),
        "EXPOSE 9121\nENTRYPOINT [\"/usr/bin/prometheus-redis-exporter\"]\n",
    ),
}

Say = Callable[[str], None]


def docker(*args: str, stdin: bytes | None = None, env: dict[str, str] | None = None,
           timeout: float | None = None) -> subprocess.CompletedProcess[bytes]:
    """`docker ARGS`, its output captured (never raises on a non-zero exit)."""
    return subprocess.run(["docker", *args], input=stdin, capture_output=True, check=False, env=env,
                          timeout=timeout)


def present(image: str) -> bool:
    return docker("image", "inspect", image).returncode == 0


def standin_of(image: str) -> str | None:
    """What a stand-in holds ('debian:prometheus 2.42.0+ds-5'), None for a real image (or none at all)."""
    done = docker("image", "inspect", "--format", f'{{{{index .Config.Labels "{LABEL}"}}}}', image)
    text = done.stdout.decode().strip()
    return text if done.returncode == 0 and text not in ("", "<no value>") else None


def ensure(image: str, say: Say) -> str | None:
    """Have `image` locally: there already, pulled, or made from Debian packages. Returns how (None: missing)."""
    if present(image):
        held = standin_of(image)
        return f"present (stand-in: {held})" if held else "present"
    pulled = docker("pull", "-q", image, timeout=600)
    if pulled.returncode == 0:
        return "pulled"
    reason = pulled.stderr.decode().strip().splitlines()[-1:] or ["?"]
    if image == DEBIAN:
        say(f"  {image}: no registry ({reason[0][:90]}); making it with debootstrap")
        make_debian(say)
        return "stand-in (debootstrap)"
    if image not in STANDINS:
        return None
    if not present(DEBIAN):
        ensure(DEBIAN, say)
    packages, tail = STANDINS[image]
    say(f"  {image}: no registry; a stand-in from Debian's {', '.join(packages)}")
    dockerfile = (f"FROM {DEBIAN}\nRUN apt-get update && apt-get install -y --no-install-recommends "
                  f"{' '.join(packages)} && rm -rf /var/lib/apt/lists/*\n{tail}")
    built = docker("build", "-q", "-t", image, "-", stdin=dockerfile.encode(), env=legacy_builder())
    if built.returncode != 0:
        raise RuntimeError(f"stand-in {image} did not build:\n{built.stderr.decode()[-2000:]}")
    version = docker("run", "--rm", "--entrypoint", "dpkg-query", image, "-W", "-f=${Version}", packages[0])
    held = f"debian:{packages[0]} {version.stdout.decode().strip()}"
    labelled = f"FROM {image}\nLABEL {LABEL}=\"{held}\"\n"
    docker("build", "-q", "-t", image, "-", stdin=labelled.encode(), env=legacy_builder())
    return f"stand-in ({held})"


@functools.cache
def legacy_builder() -> dict[str, str]:
    """The environment for `docker build`: the legacy builder where the buildx plugin (BuildKit) is missing, as with
    Debian's engine, where a recent CLI would refuse to build."""
    if "DOCKER_BUILDKIT" in os.environ or docker("buildx", "version").returncode == 0:
        return dict(os.environ)
    return {**os.environ, "DOCKER_BUILDKIT": "0"}


def apt_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 or one-line sources), else deb.debian.org."""
    for path in [*sorted(Path("/etc/apt/sources.list.d").glob("*.sources")), Path("/etc/apt/sources.list")]:
        try:
            text = path.read_text()
        except OSError:
            continue
        for uri in re.findall(r"^(?:URIs:\s*|deb\s+(?:\[[^]]*\]\s+)?)(\S+)", text, re.M):
            if uri.rstrip("/").endswith("/debian"):
                return str(uri)
    return "http://deb.debian.org/debian"


def host_extra_cas() -> list[str]:
    """The certificates in this machine's CA bundle that Debian's ca-certificates does not ship (a TLS-intercepting
    proxy's CA, a company CA): builds inside the stand-ins reach PyPI through the same proxy."""
    def pems(text: str) -> list[str]:
        return re.findall(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", text, re.S)

    try:
        bundle = pems(Path("/etc/ssl/certs/ca-certificates.crt").read_text())
    except OSError:
        return []
    shipped = {"".join(p.split()) for f in Path("/usr/share/ca-certificates").rglob("*.crt")
               for p in pems(f.read_text())}
    return [p + "\n" for p in bundle if "".join(p.split()) not in shipped]


def make_debian(say: Say, suite: str = "bookworm") -> None:
    """debootstrap a minimal Debian into a temporary directory and import it as `debian:bookworm-slim`; its apt
    reads the same mirrors as this machine's (the Debian sources are copied in)."""
    if shutil.which("debootstrap") is None:
        raise RuntimeError("no registry and no debootstrap: `apt-get install -y debootstrap` (as root)")
    mirror = apt_mirror()
    with tempfile.TemporaryDirectory(prefix="kvstash-rootfs-", dir="/var/tmp") as tmp:
        root = Path(tmp) / "rootfs"
        say(f"  debootstrap --variant=minbase {suite} ({mirror}): a few minutes")
        done = subprocess.run(["debootstrap", "--variant=minbase", suite, str(root), mirror],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"debootstrap failed:\n{done.stdout[-1500:]}{done.stderr[-1500:]}")
        sources = Path("/etc/apt/sources.list.d/debian.sources")
        if sources.is_file():  # the host's suites (updates, security) as well, in place of debootstrap's one line
            shutil.copy(sources, root / "etc/apt/sources.list.d/debian.sources")
            (root / "etc/apt/sources.list").unlink(missing_ok=True)
        extra = host_extra_cas()
        (root / "usr/local/share/ca-certificates").mkdir(parents=True, exist_ok=True)
        for n, pem in enumerate(extra):  # ca-certificates, where an image installs it, trusts them too
            (root / f"usr/local/share/ca-certificates/host-{n}.crt").write_text(pem)
        if extra:
            say(f"  the {len(extra)} CA certificate(s) this machine trusts beyond Debian's (a TLS proxy) go in too")
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (root / junk).glob("*"):
                if path.is_file():
                    path.unlink()
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(["docker", "import", "--change", 'CMD ["bash"]',
                                   "--change", f'LABEL {LABEL}="debootstrap {suite}"', "-", DEBIAN],
                                  stdin=tar.stdout, capture_output=True, check=False)
        tar.wait()
        if imported.returncode != 0:
            raise RuntimeError(f"docker import failed: {imported.stderr.decode()}")


def local_torch_wheel() -> Path | None:
    """The CPU torch wheel in a find-links directory pip is configured with here (PIP_FIND_LINKS, pip config)."""
    dirs = os.environ.get("PIP_FIND_LINKS", "").split()
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=False).stdout
    for line in (x for x in listed.splitlines() if ".find-links=" in x):
        dirs += line.split("=", 1)[1].strip("'").split()
    version = TORCH.split("==")[1]
    for d in dirs:
        found = sorted(Path(d.removeprefix("file://")).glob(f"torch-{version}+cpu-*.whl"))
        if found:
            return found[0]
    return None


class _TorchIndex(http.server.SimpleHTTPRequestHandler):
    """torch from the directory; every other project (torch's own requirements, which the CPU index mirrors)
    redirected to PyPI's page for it."""

    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        if self.path.startswith("/simple/") and not self.path.startswith("/simple/torch/"):
            self.send_response(302)
            self.send_header("Location", "https://pypi.org" + self.path)
            self.end_headers()
            return
        super().do_GET()

    def log_message(self, *_: object) -> None:
        pass


@contextlib.contextmanager
def torch_index(say: Say) -> Iterator[tuple[str, list[str]]]:
    """(TORCH_INDEX_URL, extra `docker build` args): the CPU index when reachable, else a local one-package index."""
    try:
        reachable = httpx.head(f"{TORCH_INDEX}/torch/", timeout=10, follow_redirects=True).status_code < 500
    except httpx.HTTPError:
        reachable = False
    if reachable:
        yield TORCH_INDEX, []
        return
    wheel = local_torch_wheel()
    if wheel is None:
        raise RuntimeError(f"{TORCH_INDEX} is out of reach and no {TORCH} CPU wheel is in pip's find-links here")
    with tempfile.TemporaryDirectory(prefix="kvstash-torch-index-") as tmp:
        page = Path(tmp) / "simple" / "torch"
        page.mkdir(parents=True)
        (page / wheel.name).symlink_to(wheel)
        (page / "index.html").write_text(f'<a href="{urllib.parse.quote(wheel.name)}">{wheel.name}</a>\n')
        handler = functools.partial(_TorchIndex, directory=tmp)
        try:
            server = http.server.ThreadingHTTPServer(("127.0.0.1", INDEX_PORT), handler)
        except OSError:
            server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        say(f"  torch: {TORCH_INDEX} out of reach; serving {wheel.name} as an index on :{server.server_port}")
        try:
            yield f"http://127.0.0.1:{server.server_port}/simple", ["--network", "host"]
        finally:
            server.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.localbase", description=__doc__.split("\n\n")[0])
    parser.add_argument("images", nargs="*", help=f"images to have (default: {DEBIAN} and every stand-in)")
    args = parser.parse_args(argv)
    missing = 0
    for image in args.images or [DEBIAN, *STANDINS]:
        how = ensure(image, print)
        print(f"{image}: {how or 'missing (no registry, no Debian package)'}", flush=True)
        missing += how is None
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
