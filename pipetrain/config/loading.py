"""Reading a recipe: YAML (bounded, so an alias bomb is refused), `--set a.b=c` overrides, paths resolved
against the recipe file, types checked against the schema, then validation; and writing one back.

build_recipe and load_recipe raise one ConfigError listing every problem at once: unknown keys (naming the
closest valid one) and wrong types first, then every problem config.validate finds, including those of
the `rules` callable it is given (the parallel keys' rules, pipetrain.parallel.mesh.rules.parallel_problems,
which config may not import: config sits below parallel).
"""
from __future__ import annotations

import difflib
import os
import typing
from typing import Any, Literal, Optional

import yaml

from pipetrain.config.schema import KEY_ALIASES, SECTIONS, ConfigError, Recipe, clip
from pipetrain.config.validation import Rules, validate
from pipetrain.shipped import anchor_shipped_paths, recipe_file, shipped_names

# Paths in a YAML file are relative to that file; paths from --set are relative to the cwd.
_PATH_KEYS = {("data", "path"), ("data", "tokenizer"), ("data", "cache_dir"),
              ("model", "init_from"), ("run", "output_dir")}


def _closest(name, options) -> str:
    """The hint after an unknown name (YAML gives keys of any type: 1:, true:, null: are not strings)."""
    match = difflib.get_close_matches(str(name), list(options), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(options))}"


def section_type_problems(section: str, values: dict) -> list[str]:
    """The values of a recipe section (a checkpoint manifest's saved one) whose types its dataclass refuses, one
    line each; keys it does not know are skipped (a checkpoint of another version may hold them)."""
    hints, problems = typing.get_type_hints(SECTIONS[section]), []
    for key, value in values.items():
        field = KEY_ALIASES.get((section, key), key)
        if field in hints:
            _check_type(f"{section}.{key}", value, hints[field], problems)
    return problems


def _check_type(where: str, value: Any, hint: Any, problems: list[str]) -> Any:
    """Coerce ints to floats where a float is expected; record a problem for any other mismatch."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check_type(where, value, inner[0], problems)
    if origin is Literal:  # by type too: 1 == True and 0 == False, so `in` let fused_loss=1 pass as true
        if not any(type(value) is type(a) and value == a for a in args):
            options = ", ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)  # as YAML writes
            problems.append(f"{where}={clip(repr(value))} is not one of {options}")
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an integer of 309 digits or more: no float holds it
            problems.append(f"{where}={clip(repr(value))} must be a finite number, got an integer past a float's range")
            return value
    if hint is float and isinstance(value, str):
        # PyYAML reads "2e-3" (no dot) as a string: accept any text that is a float literal.
        try:
            return float(value)
        except ValueError:
            pass
    if hint is list:
        if not isinstance(value, list):
            problems.append(f"{where}={clip(repr(value))} must be a list")
        return value
    expected = {int: int, float: float, str: str, bool: bool}.get(hint)
    if expected is not None:
        ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if not ok:
            problems.append(f"{where}={clip(repr(value))} must be {expected.__name__}, got {type(value).__name__}")
    return value


def _resolve_path(value: Optional[str], base: str) -> Optional[str]:
    """Make a relative path absolute against base; a hub name ("gpt2", "user/corpus") with no such
    local path stays as written."""
    if not value:
        return value
    expanded = os.path.expanduser(value)
    if os.path.isabs(expanded):
        return expanded
    candidate = os.path.normpath(os.path.join(base, expanded))
    looks_local = expanded.startswith(".") or os.path.exists(candidate)
    return candidate if looks_local or expanded.count("/") > 1 else value


def _resolve_paths(section: str, key: str, value: Any, base: str) -> Any:
    """A path key's value, or data.sources' path entries, resolved against base (the recipe file's folder,
    or the current directory for --set)."""
    if (section, key) in _PATH_KEYS and isinstance(value, str):
        return _resolve_path(value, base)
    if (section, key) == ("data", "sources") and isinstance(value, list):  # each source path as data.path
        return [{**s, "path": _resolve_path(s["path"], base)} if isinstance(s, dict) and isinstance(s.get("path"), str)
                else s for s in value]
    return value


# What a recipe may expand to: a YAML alias names a node again, so a small file can describe a
# structure of billions of nodes ("billion laughs"); these bound it before any Python object is built.
MAX_RECIPE_BYTES = 1 << 20      # 1 MiB of YAML text
MAX_RECIPE_NODES = 100_000      # scalars, lists and mappings after aliases are expanded
MAX_RECIPE_DEPTH = 32           # nesting of lists and mappings


def bounded_yaml(text: str, where: str) -> Any:
    """yaml.safe_load of text, refused (ConfigError) past MAX_RECIPE_BYTES / NODES / DEPTH."""
    if len(text) > MAX_RECIPE_BYTES:
        raise ConfigError(f"{where}: {len(text)} characters of YAML, over the {MAX_RECIPE_BYTES} limit; "
                          "a recipe is a short file of settings")
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        count, stack = 0, [(node, 1)]
        while stack:  # walks aliases as often as they are used: what construction would expand
            item, depth = stack.pop()
            count += 1
            if count > MAX_RECIPE_NODES or depth > MAX_RECIPE_DEPTH:
                raise ConfigError(f"{where}: the YAML expands past {MAX_RECIPE_NODES} nodes or "
                                  f"{MAX_RECIPE_DEPTH} levels (aliases count each time they are used); "
                                  "write the values out plainly")
            if isinstance(item, yaml.SequenceNode):
                stack.extend((child, depth + 1) for child in item.value)
            elif isinstance(item, yaml.MappingNode):
                stack.extend((child, depth + 1) for pair in item.value for child in pair)
        _refuse_duplicate_keys(node, where)
        return loader.construct_document(node)
    except ConfigError:
        raise
    except ValueError as exc:  # int() past Python's digit limit, and the like: a value no key can hold
        raise ConfigError(f"{where}: a value cannot be read ({clip(str(exc))}); write it as a plain number or "
                          "string") from None
    except RecursionError:  # PyYAML's composer recurses per level: ~1,000 levels overflow it before the walk
        raise ConfigError(f"{where}: the YAML nests past {MAX_RECIPE_DEPTH} levels; write the values out "
                          "plainly") from None
    finally:
        loader.dispose()


def _refuse_duplicate_keys(node: Any, where: str) -> None:
    """ConfigError for a key given twice in one mapping (a second `train:` section): YAML keeps the last one
    silently, dropping every key of the first."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, yaml.MappingNode):
            seen = set()
            for key, value in item.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else None
                if name is not None and name in seen:
                    line = key.start_mark.line + 1
                    raise ConfigError(f"{where}: key {clip(repr(name))} is given twice at line {line} (YAML would "
                                      "keep the last one only); merge the two into one")
                seen.add(name)
                stack.append(value)
        elif isinstance(item, yaml.SequenceNode):
            stack.extend(item.value)


def _one_line(problem: Any) -> str:
    """A YAML error's problem as one line (a reader error's text names the position on a line of its own)."""
    return clip(" ".join(str(problem).split()))


def parse_override(text: str) -> tuple[str, str, Any]:
    """'parallel.tp=2' -> ('parallel', 'tp', 2); the value is parsed as a YAML scalar."""
    if "=" not in text:
        raise ConfigError(f"--set {clip(repr(text))}: expected KEY=VALUE such as parallel.tp=2")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2:
        raise ConfigError(f"--set {clip(repr(text))}: key must be SECTION.NAME such as train.steps")
    try:
        value = bounded_yaml(raw, f"--set {clip(key)}") if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {clip(repr(text))}: value is not a YAML scalar "
                          f"({_one_line(getattr(exc, 'problem', None) or exc)})") from None
    return parts[0], parts[1], value


def build_recipe(raw: dict, overrides: list[str] = (), base_dir: str | None = None,
                 rules: Rules | None = None) -> Recipe:
    """Build and validate a Recipe from a nested dict plus overrides; raise one ConfigError for all problems.
    rules: the parallel keys' rules for config.validate (pass pipetrain.parallel.mesh.rules.parallel_problems
    wherever the recipe will run; without them only the keys config owns are checked)."""
    problems: list[str] = []
    base_dir = base_dir or os.getcwd()
    if not isinstance(raw, dict):
        raise ConfigError("recipe: top level must be a mapping of sections (model, parallel, train, ...)")
    values: dict[str, dict] = {name: {} for name in SECTIONS}
    for section, body in raw.items():
        if section not in SECTIONS:
            problems.append(f"unknown section '{section}'{_closest(section, SECTIONS)}")
            continue
        if body is None:
            continue
        if not isinstance(body, dict):
            problems.append(f"section '{section}' must be a mapping of keys")
            continue
        for key, value in body.items():
            values[section][key] = _resolve_paths(section, key, value, base_dir)
    for text in overrides:
        section, key, value = parse_override(text)
        if section not in SECTIONS:
            problems.append(f"--set {text}: unknown section '{section}'{_closest(section, SECTIONS)}")
            continue
        values[section][key] = _resolve_paths(section, key, value, os.getcwd())

    sections = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, value in values[section].items():
            field = KEY_ALIASES.get((section, key), key)
            if field not in hints:
                problems.append(f"unknown key '{section}.{key}'{_closest(key, hints)}")
                continue
            kwargs[field] = _check_type(f"{section}.{key}", value, hints[field], problems)
        if problems:
            continue
        sections[section] = cls(**kwargs)
    if problems:
        raise ConfigError("; ".join(problems))
    recipe = Recipe(**sections)
    problems = validate(recipe, rules)
    if problems:
        raise ConfigError("; ".join(problems))
    return recipe


def load_recipe(path: str, overrides: list[str] = (), rules: Rules | None = None) -> Recipe:
    """Read a YAML recipe file (or the shipped recipe of that name, pipetrain.shipped), apply overrides, validate
    (with rules as build_recipe)."""
    file = recipe_file(path)
    if file is None:
        raise ConfigError(f"--recipe: not found as a file or a shipped recipe name, got {path!r}; pass a recipe "
                          f"file's path or a shipped name ({', '.join(shipped_names())})")
    try:
        with open(file, "rb") as f:
            data = f.read(MAX_RECIPE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"recipe {path}: cannot be read ({exc.strerror or exc}); check the path and its "
                          "permissions") from None
    try:  # past MAX_RECIPE_BYTES the read may end inside a character: bounded_yaml refuses the size instead
        text = data.decode("utf-8", errors="strict" if len(data) <= MAX_RECIPE_BYTES else "replace")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"recipe {path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                          "save the recipe as UTF-8 YAML") from None
    try:
        raw = bounded_yaml(text, f"recipe {path}") or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"recipe {path}: invalid YAML{where}: {_one_line(getattr(exc, 'problem', None) or exc)}") \
            from None
    if file != path:  # found by name: shipped data stays in the package, output goes under the current directory
        return build_recipe(anchor_shipped_paths(raw, _PATH_KEYS), overrides, base_dir=os.getcwd(), rules=rules)
    return build_recipe(raw, overrides, base_dir=os.path.dirname(os.path.abspath(path)), rules=rules)


def dump_recipe(r: Recipe, path: str) -> None:
    """Write r as YAML, recipe keys as a recipe spells them (checkpoint.async), readable by load_recipe. Written
    beside path and renamed over it: a link named path is replaced, never written through."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            yaml.safe_dump(r.to_dict(), f, sort_keys=False)
        os.replace(tmp, path)
    except OSError as exc:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise ConfigError(f"{path} cannot be written ({exc.strerror or exc}); remove what is there, or choose "
                          "another folder") from None
