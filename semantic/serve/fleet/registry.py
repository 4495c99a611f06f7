"""Which models a server serves and what names reach them: ``--model``, ``--models-file``, ``--models-dir``, aliases.

Pure data, checked once when built; the fleet (``semantic.serve.fleet.fleet``) loads and unloads what it names.
A name a client sends resolves in this order::

    1. a model's id                      "main"
    2. an alias without wildcards        "gpt-4o" = "main"
    3. glob aliases, most literal first  "claude-*haiku*" (12 literal chars) before "claude-*" (7)
    4. a folder under --models-dir that appeared since the last scan
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,127}$")
WILDCARDS = "*?["
# what a models file may set for one model (and under [defaults] for all of them)
OPTION_KEYS = ("path", "aliases", "pinned", "idle_ttl_s", "max_context", "kv_bits", "pool_mb", "ram_mb", "disk_mb",
               "tool_parser")
KV_BITS = (2, 3, 4, 5, 6, 8)


class RegistryError(ValueError):
    """A model list that cannot be served: the message names the flag or key to fix."""


@dataclass(frozen=True, slots=True)
class ModelOptions:
    """Per-model settings; None: the server's flag (``--pool-mb`` and the rest)."""

    pinned: bool = False
    idle_ttl_s: float | None = None
    max_context: int | None = None
    kv_bits: int | None = None
    pool_mb: int | None = None
    ram_mb: int | None = None
    disk_mb: int | None = None
    tool_parser: str | None = None


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One served model: the id clients use, where its weights are, and its options."""

    id: str
    source: str  # a directory or a hub id, as ``mlx_lm.load`` takes it
    options: ModelOptions = field(default_factory=ModelOptions)


@dataclass(frozen=True, slots=True)
class Alias:
    pattern: str
    target: str
    order: int  # declaration order: the tie-break between equally specific globs

    @property
    def is_glob(self) -> bool:
        return any(c in self.pattern for c in WILDCARDS)

    @property
    def literal(self) -> int:
        return sum(c not in WILDCARDS for c in self.pattern)


class Registry:
    """The served models in declaration order (the first is the default) and the aliases to them.

    ``single``: one bare ``--model`` and nothing else, today's server: loaded at start, never unloaded.
    """

    def __init__(self, entries: list[ModelEntry], aliases: list[Alias] = (), models_dir: str | None = None,
                 defaults: ModelOptions = ModelOptions(), single: bool = False):
        self.entries: dict[str, ModelEntry] = {}
        self.models_dir, self.defaults, self.single = models_dir, defaults, single
        for e in entries:
            self._add(e)
        if not self.entries and models_dir is None:
            raise RegistryError("no model to serve: give --model, --models-file or --models-dir")
        self.aliases: list[Alias] = []
        for a in aliases:
            self.add_alias(a.pattern, a.target)
        self._scanned: set[str] = set()
        if models_dir is not None:
            self.rescan()
            if not self.entries:
                raise RegistryError(f"--models-dir {models_dir}: no model directory (one with a config.json) in it")

    @property
    def default(self) -> str:
        return next(iter(self.entries))

    def _add(self, entry: ModelEntry) -> None:
        if not self.single and not ID_RE.match(entry.id):  # one model alone keeps any name, as it always did
            raise RegistryError(f"model id {entry.id!r}: use letters, digits and . _ : @ + - (at most 128)")
        if entry.id in self.entries:
            raise RegistryError(f"model id {entry.id!r} is given twice")
        same = next((e.id for e in self.entries.values() if _same_source(e.source, entry.source)), None)
        if same is not None:  # two stores on one cache directory would overwrite each other's manifests
            raise RegistryError(f"models {same!r} and {entry.id!r} are the same weights ({entry.source}): serve it "
                                f"once and give the other name as an alias ({entry.id}={same})")
        self.entries[entry.id] = entry

    def add_alias(self, pattern: str, target: str) -> None:
        if not pattern or any(c.isspace() for c in pattern):
            raise RegistryError(f"alias {pattern!r}: a name or glob pattern without spaces")
        if target not in self.entries:
            raise RegistryError(f"alias {pattern!r} points at {target!r}, which is not a served model "
                                f"(served: {', '.join(self.entries)})")
        if pattern in self.entries:
            raise RegistryError(f"alias {pattern!r} is a model's own id")
        if any(a.pattern == pattern for a in self.aliases):
            raise RegistryError(f"alias {pattern!r} is given twice")
        self.aliases.append(Alias(pattern, target, len(self.aliases)))

    def aliases_of(self, model_id: str) -> list[str]:
        return [a.pattern for a in self.aliases if a.target == model_id]

    def resolve(self, name: str | None) -> str | None:
        """The id of the model ``name`` reaches (None: the default), or None when nothing matches."""
        if name is None:
            return self.default
        hit = self._match(name)
        if hit is None and self.models_dir is not None and self.rescan():
            hit = self._match(name)
        return hit

    def _match(self, name: str) -> str | None:
        if name in self.entries:
            return name
        exact = next((a.target for a in self.aliases if not a.is_glob and a.pattern == name), None)
        if exact is not None:
            return exact
        globs = sorted((a for a in self.aliases if a.is_glob), key=lambda a: (-a.literal, a.order))
        return next((a.target for a in globs if fnmatch.fnmatchcase(name, a.pattern)), None)

    def rescan(self) -> bool:
        """Add the model folders under ``models_dir`` not seen before; whether any was added."""
        root = Path(self.models_dir).expanduser()
        if not root.is_dir():
            return False
        added = False
        for sub in sorted(root.iterdir()):
            if sub.name in self._scanned or not (sub / "config.json").is_file():
                continue
            self._scanned.add(sub.name)
            if sub.name in self.entries or not ID_RE.match(sub.name):
                continue
            if any(_same_source(e.source, str(sub)) for e in self.entries.values()):
                continue  # already served under another id
            self.entries[sub.name] = ModelEntry(sub.name, str(sub), self.defaults)
            added = True
        return added

    def served_names(self) -> str:
        """For a 404: the ids and the aliases."""
        names = ", ".join(repr(i) for i in self.entries)
        aliases = ", ".join(f"{a.pattern}→{a.target}" for a in self.aliases)
        return f"models {names}" + (f"; aliases {aliases}" if aliases else "")


def _same_source(a: str, b: str) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return a == b


# ---------------------------------------------------------------- building one


def parse_model_arg(value: str) -> tuple[str | None, str]:
    """``ID=PATH`` → (ID, PATH); a bare path or hub id → (None, it). A path that exists is never split."""
    if "=" in value and not Path(value).expanduser().exists():
        name, _, source = value.partition("=")
        if ID_RE.match(name) and source:
            return name, source
        raise RegistryError(f"--model {value!r}: give ID=DIR_OR_HUB_ID (an id of letters, digits and . _ : @ + -)"
                            " or a bare directory or hub id")
    return None, value


def parse_alias_arg(value: str) -> tuple[str, str]:
    pattern, sep, target = value.rpartition("=")
    if not sep or not pattern or not target:
        raise RegistryError(f"--alias {value!r}: give PATTERN=MODEL_ID, e.g. 'claude-*haiku*=small'")
    return pattern, target


def options_from(doc: dict, where: str, base: ModelOptions = ModelOptions()) -> ModelOptions:
    """A models-file table's options over ``base``, each checked; an unknown key names itself."""
    unknown = sorted(set(doc) - set(OPTION_KEYS))
    if unknown:
        raise RegistryError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(OPTION_KEYS)})")
    out = {}
    for key in ("max_context", "pool_mb", "ram_mb", "disk_mb"):
        if key in doc:
            out[key] = _positive_int(doc[key], f"{where}.{key}")
    if "idle_ttl_s" in doc:
        v = doc["idle_ttl_s"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise RegistryError(f"{where}.idle_ttl_s must be a number of seconds >= 0 (0: never), got {v!r}")
        out["idle_ttl_s"] = float(v)
    if "kv_bits" in doc:
        if doc["kv_bits"] not in KV_BITS or isinstance(doc["kv_bits"], bool):
            raise RegistryError(f"{where}.kv_bits must be one of {KV_BITS}, got {doc['kv_bits']!r}")
        out["kv_bits"] = doc["kv_bits"]
    if "pinned" in doc:
        if not isinstance(doc["pinned"], bool):
            raise RegistryError(f"{where}.pinned must be true or false, got {doc['pinned']!r}")
        out["pinned"] = doc["pinned"]
    if "tool_parser" in doc:
        if not isinstance(doc["tool_parser"], str) or not doc["tool_parser"]:
            raise RegistryError(f"{where}.tool_parser must name a parser, got {doc['tool_parser']!r}")
        out["tool_parser"] = doc["tool_parser"]
    opts = replace(base, **out)
    if opts.ram_mb is not None and opts.pool_mb is not None and opts.ram_mb > opts.pool_mb:
        raise RegistryError(f"{where}: ram_mb {opts.ram_mb} exceeds pool_mb {opts.pool_mb}")
    return opts


def _positive_int(v, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise RegistryError(f"{where} must be a positive integer, got {v!r}")
    return v


def read_models_file(path: str, base: ModelOptions = ModelOptions()) \
        -> tuple[list[ModelEntry], list[tuple[str, str]], ModelOptions]:
    """A TOML models file: its models (declaration order), its aliases (pattern, id) and its defaults
    (its [defaults] over ``base``, the flags')."""
    file = Path(path).expanduser()
    try:
        doc = tomllib.loads(file.read_text(encoding="utf-8"))
    except OSError as exc:
        raise RegistryError(f"--models-file {path}: cannot read it ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise RegistryError(f"--models-file {path}: not TOML ({exc})") from None
    unknown = sorted(set(doc) - {"defaults", "models", "aliases"})
    if unknown:
        raise RegistryError(f"--models-file {path}: unknown table {unknown[0]!r} (known: defaults, models, aliases)")
    defaults_doc = doc.get("defaults", {})
    if not isinstance(defaults_doc, dict) or "path" in defaults_doc or "aliases" in defaults_doc:
        raise RegistryError(f"--models-file {path}: [defaults] holds per-model options, not path or aliases")
    defaults = options_from(defaults_doc, "defaults", base)
    entries, aliases = [], []
    for model_id, table in (doc.get("models") or {}).items():
        where = f"models.{model_id}"
        if not isinstance(table, dict) or not isinstance(table.get("path"), str) or not table["path"]:
            raise RegistryError(f"--models-file {path}: [{where}] needs path = \"DIR_OR_HUB_ID\"")
        source = table["path"]
        local = Path(source).expanduser()
        if not local.is_absolute() and (file.parent / local).exists():
            source = str((file.parent / local).resolve())  # relative to the file, as a reader expects
        names = table.get("aliases", [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise RegistryError(f"--models-file {path}: {where}.aliases must be a list of names or patterns")
        opts = options_from({k: v for k, v in table.items() if k not in ("path", "aliases")}, where, defaults)
        entries.append(ModelEntry(model_id, source, opts))
        aliases += [(n, model_id) for n in names]
    table = doc.get("aliases", {})
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
        raise RegistryError(f"--models-file {path}: [aliases] maps names or patterns to model ids")
    aliases += list(table.items())
    return entries, aliases, defaults


def build(models: list[str], *, model_id: str | None = None, models_file: str | None = None,
          models_dir: str | None = None, aliases: list[str] = (), pins: list[str] = (),
          defaults: ModelOptions = ModelOptions()) -> Registry:
    """The registry the command line asks for: ``--models-file`` models first, then ``--model``s, then the
    folders of ``--models-dir``; ``defaults``: the flags' per-model options (a file's [defaults] override them)."""
    entries: list[ModelEntry] = []
    pairs: list[tuple[str, str]] = []
    if models_file is not None:
        entries, pairs, defaults = read_models_file(models_file, defaults)
    parsed = [parse_model_arg(m) for m in models]
    bare = [src for name, src in parsed if name is None]
    single = len(bare) == len(parsed) == 1 and models_file is None and models_dir is None
    if model_id is not None and not single:
        raise RegistryError("--model-id names the one model of a single --model DIR; with several models give "
                            "--model ID=DIR, or an --alias")
    for name, src in parsed:
        if name is None:
            p = Path(src).expanduser()
            name = (model_id if single else None) or (p.name if p.is_dir() else src)
        entries.append(ModelEntry(name, src, replace(defaults, pinned=True) if single else defaults))
    registry = Registry(entries, models_dir=models_dir, defaults=defaults, single=single)
    for pattern, target in pairs + [parse_alias_arg(a) for a in aliases]:
        registry.add_alias(pattern, target)
    for pin in pins:
        if pin not in registry.entries:
            raise RegistryError(f"--pin {pin!r} is not a served model (served: {', '.join(registry.entries)})")
        e = registry.entries[pin]
        registry.entries[pin] = replace(e, options=replace(e.options, pinned=True))
    return registry

