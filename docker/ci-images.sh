#!/usr/bin/env bash
# Builds, runs and tests both images on this machine, with no Docker daemon and no registry.
# Called by .ci/run; a developer runs it the same way after a test build.
#
#   bash docker/ci-images.sh tools   # only install the tools (podman, mmdebstrap, podman-compose,
#                                    # check-jsonschema); idempotent, seconds when present
#   bash docker/ci-images.sh         # tools, schema checks, base stand-ins, build, image checks,
#                                    # then the container tests against the local chain
#
# The images are built from the unchanged docker/Dockerfile.* with podman (buildah inside):
# `--build-context build=DIR` stands a folder in for the Dockerfile's `build` stage, holding the
# same paths that stage makes (/engy-validator, /engy-miner, /image/data) from the binaries the
# test run already built, so CI pays no second compile. Those are DEBUG binaries (stripped, as the
# build stage strips): what these checks test is the packaging (layout, users, modes, labels,
# HEALTHCHECK, the libraries the binary links in the distroless base, the daemons' behaviour in
# a container), which a release build does not change; a cold release build of both binaries
# would cost CI's 2 cores far more than this whole script. The published images are release
# builds (.github/workflows/images.yml).
#
# The base images cannot be pulled here: mmdebstrap makes a stand-in for
# gcr.io/distroless/cc-debian12:nonroot from Debian's packages (glibc, libgcc, libstdc++, libssl3,
# netbase, the CA bundle, users root/nobody/nonroot 65532, /tmp 1777, no shell), imported under
# that exact name so `FROM` resolves with --pull=never. The `build` stage's rust image is never
# needed: podman skips a stage that a build context replaces.
#
# Env (all optional):
#   ENGY_IMAGE_BIN_DIR   folder holding engy-validator and engy-miner
#                        (default: $CARGO_TARGET_DIR/debug, where tests/run.sh built them)
#   ENGY_SHARED_DIR      the shared folder beside the project (default ../shared)
#   ENGY_CHAIN_PORT      port of the local chain the container tests start (default 19944)
#   ENGY_IMAGES_STATE    podman settings for this script (default ~/.cache/engy-ci-images)
set -Eeuo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
T0=$SECONDS
STEP_T=$SECONDS
say() { echo "[ci-images] $(date -u +%H:%M:%S) $*"; }
fail() { say "FAIL: $*"; exit 1; }
# Prints how long the previous step took, then names the next one.
step() {
  local now=$SECONDS
  say "$* (previous step $((now - STEP_T)) s)"
  STEP_T=$now
}
trap 'say "FAILED (exit $?) at line $LINENO"' ERR

STATE="${ENGY_IMAGES_STATE:-${XDG_CACHE_HOME:-$HOME/.cache}/engy-ci-images}"
APT_PKGS=(podman buildah runc fuse-overlayfs uidmap slirp4netns containernetworking-plugins iptables mmdebstrap)
PIP_PKGS=('podman-compose==1.6.0' 'check-jsonschema==0.39.0')
VALIDATOR_IMAGE=localhost/engy-validator:ci
MINER_IMAGE=localhost/engy-miner:ci
BASE_IMAGE=gcr.io/distroless/cc-debian12:nonroot
SOURCE_URL=https://github.com/engy-sn53/engy

tools() {
  local missing=() p
  for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    say "apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "${PIP_PKGS[@]}"
  # a pyenv python puts new commands on PATH through its shims
  if command -v pyenv >/dev/null; then pyenv rehash || say "pyenv rehash failed (another one running?)"; fi
  # runc, with limits this machine lets a container have: crun fails on this kernel's hybrid
  # cgroups, and podman's default limits (nofile 1048576) are above the hard limits, which makes
  # runc fail with "error setting rlimit type 7 (nofile) / 6 (nproc): operation not permitted";
  # nproc above kernel.pid_max fails the same way.
  local nofile nproc pid_max
  nofile="$(ulimit -Hn)"
  nproc="$(ulimit -Hu)"
  pid_max="$(cat /proc/sys/kernel/pid_max)"
  [ "$nofile" != unlimited ] && [ "$nofile" -le 1048576 ] || nofile=1048576
  [ "$nproc" != unlimited ] && [ "$nproc" -le "$pid_max" ] || nproc="$pid_max"
  mkdir -p "$STATE"
  cat >"$STATE/containers.conf" <<EOF
# Written by docker/ci-images.sh: podman settings for the image checks on this machine.
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
EOF
  podman --version
  podman-compose --version 2>/dev/null | grep -i podman-compose
  check-jsonschema --version
}

# Every compose file against the compose spec, every workflow against GitHub's workflow schema
# (both schemas are built into check-jsonschema: no network).
schemas() {
  # every compose file, under our names and the original runbook's (links)
  check-jsonschema --builtin-schema vendor.compose-spec docker/compose*.yml docker/docker-compose*.yml
  check-jsonschema --builtin-schema vendor.github-workflows .github/workflows/*.yml
  # One workflow publishes both images (:staging and :sha-… from main; X.Y.Z, X.Y, latest from
  # tags): a second one would race it for the same tags.
  local publishers
  publishers="$(grep -l 'docker/build-push-action\|imagetools create' .github/workflows/*.yml | tr '\n' ' ')"
  [ "$publishers" = ".github/workflows/images.yml " ] ||
    fail "image-publishing workflows: ${publishers:-none}(only .github/workflows/images.yml may publish)"
  # The publishing workflow's build arguments are ARGs of both Dockerfiles (a misspelt one is
  # ignored by the build: an image without its commit).
  local arg f
  for arg in $(sed -n 's/^ *\(ENGY_[A-Z_]*\)=.*/\1/p' .github/workflows/images.yml | sort -u); do
    for f in docker/Dockerfile.validator docker/Dockerfile.miner; do
      grep -q "^ARG $arg\(=\|\$\)" "$f" || fail ".github/workflows/images.yml passes $arg, which $f does not declare (ARG)"
    done
  done
}

# The distroless stand-in, under the name the Dockerfiles use. Kept between runs.
base_standin() {
  if podman image exists "$BASE_IMAGE"; then
    say "$BASE_IMAGE stand-in present"
    return
  fi
  local dir
  dir="$(mktemp -d)"
  mmdebstrap --quiet --variant=extract --skip=output/dev \
    --include=libc6,libgcc-s1,libstdc++6,libgomp1,libssl3,netbase bookworm "$dir/root"
  local r="$dir/root"
  chmod 755 "$r"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$r/etc/passwd"
  printf 'root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n' >"$r/etc/group"
  mkdir -p "$r/home/nonroot" "$r/tmp" "$r/etc/ssl/certs"
  chown 65532:65532 "$r/home/nonroot"
  chmod 700 "$r/home/nonroot"
  chmod 1777 "$r/tmp"
  cp /etc/ssl/certs/ca-certificates.crt "$r/etc/ssl/certs/ca-certificates.crt"
  ldconfig -r "$r"
  rm -rf "$r/var/cache/apt" "$r/var/lib/apt/lists" "$r/usr/share/doc" "$r/usr/share/man"
  [ ! -e "$r/bin/sh" ] || fail "the distroless stand-in has a shell"
  tar -C "$r" -c . | podman import \
    --change 'USER 65532:65532' --change 'WORKDIR /home/nonroot' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
    - "$BASE_IMAGE" >/dev/null
  rm -rf "$dir"
  say "$BASE_IMAGE stand-in made"
}

# build NAME: the image from docker/Dockerfile.NAME with the test run's binary.
build() {
  local name="$1" image="$2" ctx="$CTX/$1"
  local bin="$BIN_DIR/engy-$name"
  [ -x "$bin" ] || fail "$bin not found: build it first (tests/run.sh, or cargo build -p engy-$name)"
  mkdir -p "$ctx/image/data"
  chmod 1777 "$ctx/image/data"
  strip -o "$ctx/engy-$name" "$bin"
  # --format docker: the OCI image format has no HEALTHCHECK (podman would drop it); BuildKit,
  # which publishes the images, keeps it in the image config as docker does. --no-cache:
  # buildah 1.28 reuses a cached LABEL step whose ARG (the commit) changed, leaving the previous
  # commit's label (seen here); the build takes seconds without the cache.
  podman build --quiet --no-cache --force-rm --pull=never --format docker --build-context "build=$ctx" \
    --build-arg "ENGY_VERSION=$VERSION" --build-arg "ENGY_GIT_COMMIT=$COMMIT" \
    -f "docker/Dockerfile.$name" -t "$image" . >/dev/null
}

inspect() { podman image inspect --format "$2" "$1"; }

# check_image NAME IMAGE MAX_MB: the checks both images share.
check_image() {
  local name="$1" image="$2" max_mb="$3" got
  local bytes mb
  bytes="$(inspect "$image" '{{.Size}}')"
  mb=$((bytes / 1000000))
  say "engy-$name image: $mb MB (limit $max_mb MB)"
  [ "$mb" -le "$max_mb" ] || fail "engy-$name image is $mb MB, above $max_mb MB"
  for kv in "version=$VERSION" "revision=$COMMIT" "source=$SOURCE_URL"; do
    got="$(inspect "$image" "{{index .Config.Labels \"org.opencontainers.image.${kv%%=*}\"}}")"
    [ "$got" = "${kv#*=}" ] || fail "engy-$name label org.opencontainers.image.${kv%%=*} is '$got', want '${kv#*=}'"
  done
  got="$(inspect "$image" '{{.Config.User}}')"
  [ "$got" = "65532:65532" ] || fail "engy-$name runs as '$got', want 65532:65532"
  got="$(inspect "$image" '{{.Config.Healthcheck.Test}}')"
  [ "$got" = "[CMD /usr/local/bin/engy-$name health]" ] || fail "engy-$name HEALTHCHECK is '$got'"
  got="$(podman run --rm --no-healthcheck --network none "$image" --version)"
  say "engy-$name --version: $got"
  case "$got" in "engy-$name $VERSION (commit $COMMIT, dirty="*) ;; *) fail "engy-$name --version is '$got', want 'engy-$name $VERSION (commit $COMMIT, dirty=…)': the binaries are not a build of this checkout" ;; esac
}

# The validator's state folder: world-writable with the sticky bit, so any uid can write it.
check_data_dir() {
  local mnt mode
  mnt="$(podman image mount "$VALIDATOR_IMAGE")"
  mode="$(stat -c '%a %U' "$mnt/data")"
  podman image unmount "$VALIDATOR_IMAGE" >/dev/null
  say "engy-validator /data: mode $mode"
  [ "$mode" = "1777 root" ] || fail "engy-validator /data is '$mode', want '1777 root' (any uid writes its state there)"
}

tools
[ "${1:-}" = tools ] && { say "tools ready ($((SECONDS - T0)) s)"; exit 0; }
export CONTAINERS_CONF="$STATE/containers.conf"

step "schemas: compose files and workflows"
schemas

step "base image stand-in"
base_standin

step "build both images"
BIN_DIR="${ENGY_IMAGE_BIN_DIR:-${CARGO_TARGET_DIR:-$ROOT/target}/debug}"
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
COMMIT="$(git rev-parse HEAD)"
CTX="$(mktemp -d)"
trap 'rm -rf "$CTX"' EXIT
say "binaries from $BIN_DIR; version $VERSION, commit $COMMIT"
build validator "$VALIDATOR_IMAGE"
build miner "$MINER_IMAGE"

step "image checks"
check_data_dir
check_image validator "$VALIDATOR_IMAGE" 100
check_image miner "$MINER_IMAGE" 100

step "container tests: the validator image on the local chain with the provider double, the miner image with the gateway and serve doubles"
PORT="${ENGY_CHAIN_PORT:-19944}"
CHAIN_STARTED=0
cleanup() {
  rm -rf "$CTX"
  [ "$CHAIN_STARTED" = 0 ] || bash "$ENGY_SHARED_DIR/chain/stop-subtensor.sh" "$PORT" >/dev/null 2>&1 || true
}
trap cleanup EXIT
export ENGY_SHARED_DIR="${ENGY_SHARED_DIR:-$(cd "$ROOT/.." && pwd)/shared}"
bash "$ENGY_SHARED_DIR/chain/start-subtensor.sh" "$PORT" --restart >/dev/null
CHAIN_STARTED=1
say "chain up on 127.0.0.1:$PORT"
# --workspace: the same feature set as tests/run.sh's build, so nothing is compiled again;
# `--test image` picks engy-validator's and engy-miner's tests/image.rs.
ENGY_SUBTENSOR_URL="ws://127.0.0.1:$PORT" ENGY_VALIDATOR_IMAGE="$VALIDATOR_IMAGE" \
  ENGY_MINER_IMAGE="$MINER_IMAGE" cargo test --workspace --locked --test image -- --nocapture

step "runbook compose commands: the original validator file names and ours, from another directory (podman-compose)"
# --workspace again: with `-p` alone cargo unifies other features and builds the tests anew
# (the CI run that ran out of disk was linking them here).
# compose is engy-validator's test, docker and docs engy-miner's.
cargo test --workspace --locked --test compose --test docker --test docs

step "tidy"
podman image prune -f >/dev/null
say "engy-validator $(inspect "$VALIDATOR_IMAGE" '{{.Size}}' | awk '{printf "%.1f MB", $1/1e6}'), engy-miner $(inspect "$MINER_IMAGE" '{{.Size}}' | awk '{printf "%.1f MB", $1/1e6}') (debug binaries, stripped)"
say "ok: images built and tested in $((SECONDS - T0)) s"
