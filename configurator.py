"""
The command line and config files of train_gpt2.py, as nanoGPT's configurator.py does it: a config file is Python
whose top-level assignments set fields of the config dataclass; `--key=value` arguments come after, in order.

    python train_gpt2.py configs/gpt2_124m.py --max_steps=100 --compile=False
"""
import ast
import dataclasses
import difflib
import os
import traceback
import types
import typing


def parse_config(config_class, argv):
    """An instance of the dataclass `config_class` from argv: config files (Python, top-level assignments) and
    --key=value overrides, applied in order. Values are parsed with ast.literal_eval, falling back to the plain
    string. Unknown keys and wrong types raise ValueError naming the key (and the closest valid one); an error in a
    config file names file:line."""
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    values = {}

    def checked(key, value, where):
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"{where}: unknown config key '{key}'{hint}")
        allowed = typing.get_args(fields[key].type) or (fields[key].type,)
        if float in allowed and type(value) is int:
            value = float(value)
        if not any(type(value) is t or (t not in (int, bool) and isinstance(value, t)) for t in allowed):
            names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{where}: {key} must be {names}, got {value!r} ({type(value).__name__})")
        return value

    def exec_config(path):
        """The namespace of config file `path` run as Python; its errors become one ValueError naming file:line."""
        namespace = {}
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            exec(compile(text, path, "exec"), namespace)
        except SyntaxError as e:
            raise ValueError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
        except SystemExit as e:  # a config must not end the run, least of all with exit status 0
            raise ValueError(f"{path}: the config file called sys.exit({e.code!r}); a config only assigns values") \
                from None
        except Exception as e:
            line = next((frame.lineno for frame in reversed(traceback.extract_tb(e.__traceback__))
                         if frame.filename == path), "?")
            raise ValueError(f"{path}:{line}: {type(e).__name__}: {e}") from None
        return namespace

    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise ValueError(f"{arg}: write overrides as --key=value")
            key, text = arg[2:].split("=", 1)
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text
            try:
                values[key] = checked(key, value, f"command line {arg}")
            except ValueError:
                if key not in fields or str not in typing.get_args(fields[key].type) + (fields[key].type,):
                    raise
                values[key] = text  # --split=969,30,1 means the string, not a tuple
        else:
            if not os.path.isfile(arg):
                raise FileNotFoundError(f"{arg}: config file not found")
            namespace = exec_config(arg)
            for key, value in namespace.items():
                if not key.startswith("_") and not isinstance(value, types.ModuleType):
                    values[key] = checked(key, value, arg)
    return config_class(**values)
