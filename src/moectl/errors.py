"""The errors moectl raises for input it refuses, and the one base they share.

Every error a user can cause — a bad flag value, a file that is not what it claims, a model moectl
cannot re-route, a budget memory cannot hold — derives from :class:`MoectlError`, so a program
catches them all with one ``except MoectlError`` and the command line prints them with one handler
(``MoectlGroup`` in ``cli/common.py``: ``error: MESSAGE``, exit code 2) instead of a traceback. An
error that is not a ``MoectlError`` is a bug in moectl and keeps its traceback.

Each error also derives from the built-in exception a caller would have caught before this base
existed (``ValueError``, ``FileNotFoundError``, ``RuntimeError``, ``NotImplementedError``, ``OSError``), so code written
against those keeps working.
"""

from __future__ import annotations


class MoectlError(Exception):
    """Base of every error moectl raises for input or state it refuses (CLI: one line, exit 2)."""


class ConfigError(MoectlError, ValueError):
    """A setting out of range, of the wrong type, or a file that is not a valid config."""


class MoectlFileError(MoectlError, FileNotFoundError):
    """A file or folder moectl needs is missing or unreadable."""


class FetchError(MoectlError, RuntimeError):
    """A package, wheel or evaluation set could not be downloaded or unpacked."""


class UnsupportedModelError(MoectlError, ValueError):
    """The model has no router moectl can re-route, or something bypasses the routers."""


class FileFormatError(MoectlError, ValueError):
    """A file is not what it claims: truncated, malformed, or another format (the message names it)."""


class OutputExistsError(MoectlError, FileExistsError):
    """An output file or folder exists already and replacing it was not asked for (``--overwrite``)."""


class OutputIsFolderError(MoectlError, IsADirectoryError):
    """An output that must be a file names a folder (the message suggests a file path)."""


class UnavailableError(MoectlError, OSError):
    """What the machine must provide is not there: room on the disk, a port to listen on."""


class MemoryLimitError(MoectlError, MemoryError):
    """What was asked for cannot fit the memory there is (the message names the limit and what fits)."""


class NotSupportedError(MoectlError, NotImplementedError):
    """A model layout or setting moectl does not support yet (the message names what to use instead)."""


class NoSuchLayerError(MoectlError, IndexError):
    """A MoE layer index the model does not have (the message names the valid range)."""


class MissingExtraError(MoectlError, ModuleNotFoundError):
    """An optional package is not installed: the message names the extra that brings it
    (``pip install 'moectl[serve]'``; :mod:`moectl.extras`)."""
