"""Builds protocol/_fastcodec.pyx, the compiled fast path of protocol.codec; everything else is in pyproject.toml.

The extension is optional: without a C compiler the install goes on, and codec warns at import and runs its
Python code alone. The build records the .pyx's sha256 (FASTCODEC_SOURCE_SHA), and codec uses the module only
if the .pyx beside it still has that hash, so a build left over from an edited .pyx is never used.
"""

import hashlib
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

SOURCE = "protocol/_fastcodec.pyx"
SHA = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()

setup(
    ext_modules=cythonize(
        [Extension("protocol._fastcodec", [SOURCE], include_dirs=[numpy.get_include()], optional=True,
                   define_macros=[("NPY_NO_DEPRECATED_API", "NPY_2_0_API_VERSION"), ("FASTCODEC_SOURCE_SHA", f'"{SHA}"')])],
        compiler_directives={"language_level": 3},
    ),
)
