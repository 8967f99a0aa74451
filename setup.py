"""Ships zero3_recompute.pth at the top of site-packages, in wheels and editable installs.

The .pth line is what activates the patch in an unchanged training script (see
zero3_recompute/autoload.py). Everything else about the package lives in pyproject.toml.
"""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "zero3_recompute.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class build_py_with_pth(build_py):
    """build_py that also places the .pth at the root of the build directory."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(HERE, PTH), os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        mapping[os.path.join(self.build_lib, PTH)] = os.path.join(HERE, PTH)
        return mapping


class editable_wheel_with_pth(editable_wheel):
    """PEP 660 editable wheel that also carries the .pth.

    setuptools writes everything under the unpacked editable wheel into site-packages; the
    .pth sorts after setuptools' own __editable__ .pth, so the package is importable by then.
    """

    def _install_namespaces(self, installation_dir, pth_prefix):
        super()._install_namespaces(installation_dir, pth_prefix)
        shutil.copyfile(os.path.join(HERE, PTH), os.path.join(installation_dir, PTH))


setup(cmdclass={"build_py": build_py_with_pth, "editable_wheel": editable_wheel_with_pth})
