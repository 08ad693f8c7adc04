"""Expert-parallel token dispatchers, chosen by the ``dispatcher`` config group (``dispatcher.name``; see
docs/dispatchers.md).

A dispatcher is the ``GroupedExperts.dispatcher`` strategy under EP: it moves every routed row to the rank that
holds its expert, runs the local experts, and brings the outputs back. The interface is ``base.Dispatcher``;
each implementation registers itself with ``@register(name)`` in its own module, and every module of this
package is imported below, so a new dispatcher is one module here plus conf/dispatcher/<name>.yaml.
"""

from __future__ import annotations

import importlib
import pkgutil

from parallelisms.dispatchers.base import DISPATCHERS, Dispatcher, dispatcher_class, register, validate_dispatcher_config
from parallelisms.dispatchers.config import DispatcherConfig

for _module in pkgutil.iter_modules(__path__):  # each dispatcher's module fills DISPATCHERS as it is imported
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["DISPATCHERS", "Dispatcher", "DispatcherConfig", "dispatcher_class", "register",
           "validate_dispatcher_config"]
