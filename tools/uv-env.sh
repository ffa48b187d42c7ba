# shellcheck shell=bash
# Sourced by tools/setup-env, tools/setup-sglang-cpu and tools/setup-megatron-cpu, which install
# with uv instead of pip: parallel downloads, one wheel cache shared by the three environments (and
# by every checkout on the machine), files hard-linked from that cache into each venv
# (docs/benchmarks.md, "Building the environments", compares the two).
#
#   uv         $RELAX_UV when set; else `uv` on PATH when it is version $relax_uv_version; else that
#              version, installed once with pip into ~/.cache/relax-hpc/uv-$relax_uv_version
#              (RELAX_UV_HOME replaces ~/.cache/relax-hpc; about 20 MB from the package index).
#   the cache  UV_CACHE_DIR, default ~/.cache/relax-hpc/uv. Safe to delete (`rm -rf` it, or
#              `uv cache clean`): the next build downloads again. On another filesystem than the
#              venvs, uv copies instead of hard-linking and says so once.
#   indexes    uv reads neither pip.conf nor PIP_* variables, so what `pip config list` says is
#              passed on: find-links, index-url, extra-index-url and constraint (each directory,
#              file:// index or file only when it exists here, so a machine without them builds from
#              the package index alone), no-index, cert (as SSL_CERT_FILE) and default-timeout (as
#              UV_HTTP_TIMEOUT). A UV_FIND_LINKS, UV_INDEX_URL, UV_EXTRA_INDEX_URL or UV_CONSTRAINT
#              that is set wins over the pip setting of the same name.
#   resolution --index-strategy unsafe-best-match: the newest version over all indexes, as pip picks.
#              But uv takes a version's files from the first index that has that version, where pip
#              weighs all of them: /opt/pypi here has soundfile 0.14.0 as a py3-none-any wheel
#              without libsndfile, /opt/pypi-more the manylinux one that bundles it. So a local
#              file:// index is passed as the directories its pages link to (--find-links), whose
#              files uv, like pip, weighs together with the index's.
#   bytecode   compiled at install (--compile-bytecode, as pip does) only where PYTHONDONTWRITEBYTECODE
#              is set: then no interpreter writes .pyc files, and every start would compile torch,
#              transformers, ... again. Otherwise each module is compiled on its first import and
#              written beside it, as Python does by default: the tests import about a third of
#              what the three environments install, and compiling everything cost about 260
#              CPU-seconds of the test command's builds (docs/testing.md). tools/test-all and
#              tools/run-tests unset the variable for this reason. An env built without it and run
#              later with it set loads what earlier runs compiled and compiles the rest in memory
#              at each start: remove the env and build it again with the variable set to compile
#              everything.
#
# Use: uv_setup NAME PYTHON (NAME prefixes messages; PYTHON runs pip for the bootstrap and for
# `pip config list`), then uv_pip_install VENV_PYTHON ARGS... (the arguments of `uv pip install`).
relax_uv_version=0.13.8
relax_uv_home="${RELAX_UV_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/relax-hpc}"
export UV_CACHE_DIR="${UV_CACHE_DIR:-$relax_uv_home/uv}"

uv_setup() {
  local name="$1" boot_python="$2"
  uv_name="$name"
  if [ -n "${RELAX_UV:-}" ]; then
    uv="$RELAX_UV"
  elif command -v uv >/dev/null 2>&1 && [ "$(uv --version 2>/dev/null | cut -d' ' -f2)" = "$relax_uv_version" ]; then
    uv="$(command -v uv)"
  else
    local dir="$relax_uv_home/uv-$relax_uv_version"
    uv="$dir/bin/uv"
    if [ ! -x "$uv" ]; then
      echo "$name: installing uv $relax_uv_version into $dir (once per machine)" >&2
      mkdir -p "$relax_uv_home"
      local tmp
      tmp="$(mktemp -d "$dir.XXXXXX")"
      PIP_ROOT_USER_ACTION=ignore "$boot_python" -m pip install --disable-pip-version-check --no-input \
        --quiet --target "$tmp" "uv==$relax_uv_version" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; } >&2
      # Another build running at the same time may have finished first: keep its copy.
      mv -T "$tmp" "$dir" 2>/dev/null || rm -rf "$tmp"
    fi
  fi
  "$uv" --version >/dev/null
  # pip's configuration, as uv options (NUL-separated; ENV:NAME=VALUE for a variable to export).
  local item
  uv_args=(--index-strategy unsafe-best-match)
  if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
    uv_args+=(--compile-bytecode)
  fi
  while IFS= read -r -d '' item; do
    case "$item" in
      ENV:*) item="${item#ENV:}"; export "${item%%=*}=${item#*=}" ;;
      *) uv_args+=("$item") ;;
    esac
  done < <("$boot_python" - <<'EOF'
import ast, glob, os, re, subprocess, sys, urllib.parse
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
rank = {"global": 0, "install": 1, ":env:": 2}  # PIP_* variables, then [install], then [global]
conf = {}
for line in out.splitlines():
    key, sep, value = line.partition("=")
    section, _, name = key.rpartition(".")
    if not sep or section not in rank:
        continue
    try:
        value = str(ast.literal_eval(value))
    except (ValueError, SyntaxError):
        continue
    if name not in conf or rank[section] >= conf[name][0]:
        conf[name] = (rank[section], value)
conf = {name: value for name, (_, value) in conf.items()}

def here(location):  # a local directory, file or file:// URL that exists here; any other URL
    if "://" in location and not location.startswith("file:"):
        return True
    return os.path.exists(location.removeprefix("file://") if location.startswith("file:") else location)

def file_dirs(index):  # the directories that a local file:// simple index's pages link to
    root = urllib.parse.unquote(urllib.parse.urlparse(index).path)
    dirs = set()
    for page in glob.glob(os.path.join(root, "*", "index.html")):
        for href in re.findall(r'href="([^"#]+)', open(page, encoding="utf-8", errors="replace").read()):
            path = urllib.parse.unquote(urllib.parse.urlparse(href).path if href.startswith("file:") else href)
            dirs.add(os.path.dirname(os.path.normpath(os.path.join(os.path.dirname(page), path))))
    return sorted(d for d in dirs if os.path.isdir(d))

args = []
for name, option, env in (("index-url", "--index-url", "UV_INDEX_URL"),
                          ("extra-index-url", "--extra-index-url", "UV_EXTRA_INDEX_URL"),
                          ("find-links", "--find-links", "UV_FIND_LINKS"),
                          ("constraint", "--constraint", "UV_CONSTRAINT")):
    if env not in os.environ:
        for location in conf.get(name, "").split():
            if not here(location):
                continue
            dirs = file_dirs(location) if name.endswith("index-url") and location.startswith("file:") else []
            if name == "index-url" and dirs:  # the local index replaces the package index: keep that
                args.append("--no-index")
            for path in dirs:
                args += ["--find-links", path]
            if not dirs:
                args += [option, location]
if conf.get("no-index", "").lower() in ("1", "true", "yes", "on"):
    args.append("--no-index")
if "cert" in conf and "SSL_CERT_FILE" not in os.environ and os.path.isfile(conf["cert"]):
    args.append("ENV:SSL_CERT_FILE=" + conf["cert"])
if conf.get("default-timeout", "").isdigit() and "UV_HTTP_TIMEOUT" not in os.environ:
    args.append("ENV:UV_HTTP_TIMEOUT=" + conf["default-timeout"])
sys.stdout.write("".join(arg + "\0" for arg in args))
EOF
)
}

uv_pip_install() {
  local py="$1"
  shift
  "$uv" pip install --quiet --python "$py" "${uv_args[@]}" "$@"
}
