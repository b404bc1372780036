"""The plugin's SGLang adapter: everything that imports SGLang or touches its objects.

`hooks` (what `sglang_ext.register` installs through SGLang's `HookRegistry`), `surface` (every
SGLang name the plugin depends on, checked at start-up), `server_args` (what the flags select
and refuse in `ServerArgs`), `factory` (the backends SGLang builds by name), `radix_cache` +
`tree_ops` + `compacted_node` (the radix cache whose compacted prefixes the SGLang-free
`sglang_ext.lifecycle` manages) and `wrapped_backend` (the attention backend). Importing this
package imports nothing of SGLang.
"""
