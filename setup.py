"""The C part of tierkv: ``tierkv.records._batchio`` (batch record I/O, tierkv/records/_batchio.c), built by pip with
the system C compiler. Optional: where it cannot be built (no compiler, no Python headers) the
package still installs, and tierkv.records.batchio uses the pure-Python fallback."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tierkv.records._batchio",
            ["tierkv/records/_batchio.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
            optional=True,
        )
    ]
)
