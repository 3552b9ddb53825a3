"""jax_patches_test: a py_test running tools/check_jax_patches.py through
jax_patches_test.py in one of its modes (--wheel or --source)."""

def jax_patches_test(name, mode, **kwargs):
    native.py_test(
        name = name,
        size = "small",
        srcs = ["jax_patches_test.py"],
        args = [mode],
        data = native.glob(["jax/*.patch"]) + [
            "jax/BASE",
            "//:pyproject.toml",
            "//tests:jax_patches_checks",
            "//tools:check_jax_patches.py",
        ],
        main = "jax_patches_test.py",
        **kwargs
    )
