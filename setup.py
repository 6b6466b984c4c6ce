"""The one C extension; everything else about the package is in pyproject.toml.

``growcache._frames`` is the vectorized reader's fused read-check-copy loop. It is optional:
where it does not build (no C compiler), growcache installs without it and the reader
falls back to numpy (``growcache.vector_reader.FUSED`` says which one runs).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("growcache._frames", ["growcache/_frames.c"], optional=True)])
