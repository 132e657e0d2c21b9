"""Builds protocol/_fastcodec.pyx (the compiled fast path of protocol.codec); the rest is in pyproject.toml."""

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("protocol._fastcodec", ["protocol/_fastcodec.pyx"], include_dirs=[numpy.get_include()],
                   define_macros=[("NPY_NO_DEPRECATED_API", "NPY_2_0_API_VERSION")])],
        compiler_directives={"language_level": 3},
    ),
)
