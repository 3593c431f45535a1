"""``--config FILE.yaml``: command-line flags read from a YAML file, as vLLM's.

The file is one mapping whose keys are the long flag names, dashed as on the command
line or underscored as in Python (``max-num-seqs`` or ``max_num_seqs``), and whose
values are the flag values::

    # tuned.yaml -- kvserve serve --config tuned.yaml --port 9000
    model: /models/qwen2.5-0.5b       # serve's positional MODEL
    max-num-seqs: 64
    enable_prefix_caching: false      # a --flag/--no-flag switch takes true or false
    kv_cache_memory: 2GiB
    max_model_len: null               # null: the flag's default, as if not given
    speculative_config:               # a mapping where the flag takes JSON
      method: ngram
      num_speculative_tokens: 4
    disable-access-log: true          # a bare switch: true gives it, false leaves it off

Every key names an option of that command (``kvserve serve --help``); an unknown key is
an error that names it and suggests close ones, never ignored. The values go through the
same parser as typed flags (:func:`config_to_argv` turns them into ``--flag=value``
tokens placed before the command line's own), so a wrong value gets argparse's own error
for that flag, and a flag given on the command line overrides the file (a repeatable
flag such as ``--stop`` given on the command line replaces the file's list). A key
naming an optional positional argument (``model`` for ``serve`` and ``run-batch``) fills
it when the command line leaves it out.

The same file serves the offline API: ``LLM(**kvserve.cli.engine_args_from_config(p))``
takes the engine keys of a file written for ``kvserve serve`` (either spelling; server
keys such as ``port`` are left out), and ``LLM(**load_config(p))`` accepts a file of engine keys
spelled with underscores, as ``LLM``'s keyword arguments are the fields of
:class:`~kvserve.engine.engine_args.EngineArgs` (``LLM(**yaml.safe_load(open(p)))`` is
the same).

Needs PyYAML at run time (imported only when a config file is read).
"""
from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvserve.engine.engine_args import EngineArgs

CONFIG_FLAG = "--config"

__all__ = ["ConfigFileError", "ConfigFileParser", "add_config_argument", "command_keys",
           "config_to_argv", "load_config", "read_engine_args"]


class ConfigFileError(ValueError):
    """A config file that cannot be read, is not a mapping, or names an unknown key."""


# -- reading the file ------------------------------------------------------------------------

def _yaml_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        """safe_load that refuses a key given twice (YAML would keep the last silently)."""

    def construct_mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=True)
            if isinstance(key, str) and key in seen:
                raise ConfigFileError(f"key {key!r} is given twice "
                                      f"(line {key_node.start_mark.line + 1})")
            if isinstance(key, str):
                seen.add(key)
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return Loader


def load_config(path: str | Path) -> dict[str, Any]:
    """The file's mapping, keys as written; an empty file is an empty mapping.

    Raises :class:`ConfigFileError` when the file cannot be read, is not YAML, is not a
    mapping, has a key that is not a string, or spells one setting twice
    (``max-num-seqs`` and ``max_num_seqs``).
    """
    try:
        import yaml
    except ImportError:
        raise ConfigFileError("reading a config file needs PyYAML (pip install pyyaml)") \
            from None

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigFileError(f"cannot read config file {str(path)!r}: "
                              f"{e.strerror or e}") from None
    try:
        data = yaml.load(text, Loader=_yaml_loader())
    except ConfigFileError as e:
        raise ConfigFileError(f"config file {str(path)!r}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigFileError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"config file {str(path)!r} must hold a mapping of flag names "
                              f"to values (e.g. 'max-num-seqs: 64'), got a "
                              f"{type(data).__name__}")
    spelled: dict[str, str] = {}
    for key in data:
        if not isinstance(key, str):
            raise ConfigFileError(f"config file {str(path)!r}: key {key!r} is not a flag "
                                  "name")
        other = spelled.setdefault(_name(key), key)
        if other != key:
            raise ConfigFileError(f"config file {str(path)!r} sets {other!r} and {key!r}, "
                                  "the same setting")
    return data


# -- mapping keys to a parser's actions -----------------------------------------------------

def _name(key: str) -> str:
    """A key as a Python name: ``max-num-seqs`` -> ``max_num_seqs``."""
    return key.replace("-", "_")


def _settable_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Underscored name -> action, for every long option and positional a file may set."""
    names: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction,
                               argparse._SubParsersAction, _ConfigAction)):
            continue
        if not action.option_strings:
            if action.dest is not argparse.SUPPRESS:
                names[_name(action.dest)] = action
            continue
        for opt in action.option_strings:
            if not opt.startswith("--"):
                continue
            if isinstance(action, argparse.BooleanOptionalAction) and opt.startswith("--no-"):
                continue
            names.setdefault(_name(opt[2:]), action)
    return names


def _unknown_key_message(key: str, known: Iterable[str], source: str) -> str:
    dashed = "-" in key
    spell = (lambda n: n.replace("_", "-")) if dashed else (lambda n: n)
    close = difflib.get_close_matches(_name(key), sorted(known), n=3, cutoff=0.6)
    where = f" in {source}" if source else ""
    if close:
        hint = "did you mean " + " or ".join(repr(spell(c)) for c in close) + "?"
    else:
        hint = "the keys are the command's long flag names (see --help)"
    if _name(key) == "config":
        hint = "a config file cannot name another config file"
    return f"unknown key {key!r}{where}: {hint}"


def _token(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _resolve(config: dict[str, Any], parser: argparse.ArgumentParser, source: str = ""
             ) -> tuple[list[tuple[argparse.Action, list[str]]], dict[argparse.Action, Any]]:
    """(option action, its tokens) per option key, and the values of positional keys."""
    actions = _settable_actions(parser)
    options: list[tuple[argparse.Action, list[str]]] = []
    positionals: dict[argparse.Action, Any] = {}
    where = f" in {source}" if source else ""
    for key, value in config.items():
        action = actions.get(_name(key)) if isinstance(key, str) else None
        if action is None:
            raise ConfigFileError(_unknown_key_message(str(key), actions, source))
        if not action.option_strings:
            if value is not None:
                positionals[action] = value
            continue
        if value is None:
            continue  # null: the flag's default, as if not given
        flag = next(o for o in action.option_strings if o.startswith("--")
                    and _name(o[2:]) == _name(key))
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise ConfigFileError(f"{key}{where} takes true or false, got {value!r}")
            options.append((action, [flag if value else "--no-" + flag[2:]]))
        elif action.nargs == 0:  # store_true / store_false / store_const
            if not isinstance(value, bool):
                raise ConfigFileError(f"{key}{where} is a switch: it takes true (give "
                                      f"{flag}) or false (leave it off), got {value!r}")
            if value:
                options.append((action, [flag]))
        elif isinstance(action, argparse._AppendAction):  # repeatable: a list or one value
            values = value if isinstance(value, list) else [value]
            options.append((action, [f"{flag}={_token(v)}" for v in values]))
        elif action.nargs in ("*", "+") or isinstance(action.nargs, int):
            values = value if isinstance(value, list) else [value]
            options.append((action, [flag, *map(_token, values)]))
        else:
            if isinstance(value, list):
                raise ConfigFileError(f"{key}{where} takes one value, got the list {value!r}")
            options.append((action, [f"{flag}={_token(value)}"]))
    return options, positionals


def config_to_argv(config: dict[str, Any], parser: argparse.ArgumentParser,
                   source: str = "") -> list[str]:
    """The command-line tokens that set ``config``'s option keys on ``parser``.

    Each key is matched to the parser's option of that long name; its value becomes
    ``--flag=value`` (numbers as written, a mapping or list as JSON, ``true``/``false``
    for switches as ``--flag``/``--no-flag``, a list as repeated ``--flag=v`` for a
    repeatable flag; null is left out). Keys naming positional arguments are left out
    here (:class:`ConfigFileParser` fills those after parsing). Raises
    :class:`ConfigFileError` for an unknown key, naming it with close matches; ``source``
    (the file's name) goes into the messages.
    """
    options, _ = _resolve(config, parser, source)
    return [tok for _, tokens in options for tok in tokens]


# -- the parser ----------------------------------------------------------------------------

class _ConfigAction(argparse.Action):
    """``--config``'s action. :class:`ConfigFileParser` takes the option out of the
    arguments before argparse sees them; this runs only where it did not."""

    def __call__(self, parser, namespace, values, option_string=None):
        if isinstance(parser, ConfigFileParser):  # so it was abbreviated (--conf)
            parser.error(f"spell {CONFIG_FLAG} out in full")
        parser.error(f"{CONFIG_FLAG} needs a parser made by {__name__}.ConfigFileParser")


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` (a :class:`ConfigFileParser`) the ``--config FILE`` option."""
    parser.add_argument(
        CONFIG_FLAG, action=_ConfigAction, default=None, metavar="FILE.yaml",
        help="read flags from a YAML mapping of long flag names (max-num-seqs or "
             "max_num_seqs) to values; flags on the command line override the file")


def _split_config(parser: argparse.ArgumentParser, args: list[str]
                  ) -> tuple[str | None, list[str]]:
    """(the --config path or None, the arguments without it)."""
    path, rest = None, []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest.extend(args[i:])
            break
        if arg == CONFIG_FLAG or arg.startswith(CONFIG_FLAG + "="):
            if arg == CONFIG_FLAG:
                if i + 1 >= len(args) or args[i + 1].startswith("-"):
                    parser.error(f"argument {CONFIG_FLAG}: expected one argument")
                value, i = args[i + 1], i + 2
            else:
                value, i = arg[len(CONFIG_FLAG) + 1:], i + 1
            if not value:
                parser.error(f"argument {CONFIG_FLAG}: expected a file name")
            if path is not None:
                parser.error(f"{CONFIG_FLAG} given more than once")
            path = value
            continue
        rest.append(arg)
        i += 1
    return path, rest


def _given(action: argparse.Action, args: Sequence[str]) -> bool:
    """Whether the command line gives this option (spelled out)."""
    for arg in args:
        if arg == "--":
            return False
        for opt in action.option_strings:
            if arg == opt or (opt.startswith("--") and arg.startswith(opt + "=")):
                return True
    return False


class ConfigFileParser(argparse.ArgumentParser):
    """An ArgumentParser whose sub-commands that have ``--config``
    (:func:`add_config_argument`) read flags from the named YAML file.

    ``add_subparsers`` makes the sub-parsers of this class too, so ``build_parser()``
    handles ``--config`` wherever it parses: the file's options become tokens put
    before the command line's own (later wins, so the command line overrides the
    file), and a key naming a positional fills it when the command line leaves it out.
    ``args.config`` is the file's path afterwards.
    """

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        if CONFIG_FLAG not in self._option_string_actions or not isinstance(
                self._option_string_actions[CONFIG_FLAG], _ConfigAction):
            return super().parse_known_args(args, namespace)
        path, rest = _split_config(self, args)
        if path is None:
            return super().parse_known_args(rest, namespace)
        try:
            options, positionals = _resolve(load_config(path), self, source=path)
        except ConfigFileError as e:
            self.error(str(e))
        tokens = [tok for action, toks in options
                  if not (isinstance(action, argparse._AppendAction) and _given(action, rest))
                  for tok in toks]
        namespace, extras = super().parse_known_args(tokens + rest, namespace)
        for action, value in positionals.items():
            self._fill_positional(namespace, action, value)
        namespace.config = path
        return namespace, extras

    def _fill_positional(self, namespace, action: argparse.Action, value: Any) -> None:
        current = getattr(namespace, action.dest, None)
        if not (current is action.default or current == []):
            return  # given on the command line
        many = action.nargs in ("*", "+") or isinstance(action.nargs, int)
        values = value if isinstance(value, list) else [value]
        if not many and isinstance(value, list):
            self.error(f"{action.dest} takes one value, got the list {value!r}")
        try:
            converted = [self._get_value(action, _token(v)) for v in values]
            for v in converted:
                self._check_value(action, v)
        except argparse.ArgumentError as e:
            self.error(str(e))
        setattr(namespace, action.dest, converted if many else converted[0])


# -- the offline API -----------------------------------------------------------------------

class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigFileError(message)


def command_keys(parser: argparse.ArgumentParser) -> set[str]:
    """Underscored names of every flag of ``parser``'s sub-commands that take --config."""
    keys: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if isinstance(sub._option_string_actions.get(CONFIG_FLAG), _ConfigAction):
                    keys |= set(_settable_actions(sub))
    return keys


def read_engine_args(path: str | Path, other_keys: set[str]) -> dict[str, Any]:
    """The EngineArgs keyword arguments (underscored field names) a config file sets,
    typed as the command line types them (``kvserve.cli.engine_args_from_config`` calls
    this with every ``kvserve`` command's keys).

    Keys in ``other_keys`` (``port``, ``host``, ...) are left out, so the file of a
    ``kvserve serve`` deployment works as is; null values are left out (the
    default); a mapping such as ``speculative_config`` stays a mapping. A key that is no
    kvserve flag raises :class:`ConfigFileError` naming it.
    """
    source = str(path)
    config = load_config(path)
    fields = EngineArgs.field_names()
    engine = {k: v for k, v in config.items() if _name(k) in fields}
    others = [k for k in config if _name(k) not in fields]
    if others:
        known = other_keys | fields
        for key in others:
            if _name(key) not in known:
                raise ConfigFileError(_unknown_key_message(key, known, source))
    parser = _RaisingParser(prog=f"config file {source!r}", add_help=False)
    EngineArgs.add_cli_args(parser)
    try:
        ns = parser.parse_args(config_to_argv(engine, parser, source))
    except ConfigFileError as e:
        raise ConfigFileError(f"config file {source!r}: {e}") from None
    result = {}
    for key, raw in engine.items():
        value = getattr(ns, _name(key))
        if value is not None:
            result[_name(key)] = raw if isinstance(raw, dict) else value
    return result
