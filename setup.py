"""The C part of tierkv: ``tierkv._batchio`` (batch record I/O, tierkv/_batchio.c), built by pip with
the system C compiler. Optional: where it cannot be built (no compiler, no Python headers) the
package still installs, and tierkv.backends.fsspec._batchio uses the pure-Python fallback."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tierkv._batchio",
            ["tierkv/_batchio.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
            optional=True,
        )
    ]
)
