"""A pydantic settings model as command-line flags and environment variables, written once.

The sampler (`sampler_pod.config.ServerConfig`) and the pool's gateway (`sampler_gateway.config.GatewayConfig`)
define each setting once, as a model field with its default and description; this turns the model
into an argparse parser (`--field-name`, a bool is a switch, a plain `list[...]` a repeatable flag)
and into `PREFIX_FIELD_NAME` variables. Flags win over the environment; a validation error exits
naming the flag and its variable.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, get_origin

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Flags(Generic[M]):
    model: type[M]
    prog: str
    description: str
    env_prefix: str
    # Fields whose flag name differs from the field name (a repeatable flag reads as singular).
    flag_names: Mapping[str, str] = field(default_factory=dict)
    # How a list is written in one environment variable.
    list_separator: str = ","

    def env_name(self, name: str) -> str:
        return self.env_prefix + name.upper()

    def flag(self, name: str) -> str:
        return self.flag_names.get(name, "--" + name.replace("_", "-"))

    def _is_bool(self, name: str) -> bool:
        return self.model.model_fields[name].annotation is bool

    def _is_list(self, name: str) -> bool:
        # Only a plain `list[...]` is a repeatable flag; `list[...] | None` (a JSON value) is not.
        return get_origin(self.model.model_fields[name].annotation) is list

    def build_parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=self.prog, description=self.description,
                                    argument_default=argparse.SUPPRESS)
        for name, info in self.model.model_fields.items():
            default = "required" if info.is_required() else f"default: {info.get_default(call_default_factory=True)}"
            help_text = f"{info.description} ({default}; env {self.env_name(name)})"
            if self._is_bool(name):
                p.add_argument(self.flag(name), dest=name, action="store_true", help=help_text)
            elif self._is_list(name):
                p.add_argument(self.flag(name), dest=name, action="append", help=help_text)
            else:
                p.add_argument(self.flag(name), dest=name, help=help_text)
        return p

    def from_env(self, environ: Mapping[str, str]) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for name in self.model.model_fields:
            raw = environ.get(self.env_name(name))
            if raw is None or raw == "":
                continue
            if self._is_bool(name):
                values[name] = raw.lower() in {"1", "true", "yes", "on"}
            elif self._is_list(name):
                values[name] = [r for r in raw.split(self.list_separator) if r]
            else:
                values[name] = raw
        return values

    def parse(self, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> M:
        parser = self.build_parser()
        flags = vars(parser.parse_args(argv))
        values = {**self.from_env(os.environ if environ is None else environ), **flags}
        try:
            return self.model(**values)
        except ValidationError as e:
            first = e.errors()[0]
            if not first.get("loc"):  # a check across fields: its message names the flags itself
                parser.error(str(first["msg"]).removeprefix("Value error, "))
            name = str(first["loc"][0])
            parser.error(f"{self.flag(name)} (or {self.env_name(name)}): {first['msg']}")
            raise  # unreachable: parser.error exits
