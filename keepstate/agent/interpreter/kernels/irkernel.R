# The `ir` kernel spec's start-up (code-interpreter-v1 template): IRkernel, with Jupyter's IPC addresses.
#
# IRkernel binds `transport://ip:port` for every transport; for IPC, Jupyter's convention (jupyter_client, and so
# the bridge) is `ipc://ip-port`. IRkernel's R code ships compiled, so instead of patching it this wraps the
# zmq.bind it imports from pbdZMQ, turning `ipc://path:port` into `ipc://path-port`. Other addresses (and a
# future IRkernel that builds them right) pass through unchanged. The template's build checks the import exists.
local({
    imports <- parent.env(asNamespace("IRkernel"))
    bind <- get("zmq.bind", envir = imports, inherits = FALSE)
    ipc_bind <- function(socket, endpoint, ...) {
        bind(socket, sub("^(ipc://.*):([0-9]+)$", "\\1-\\2", endpoint), ...)
    }
    unlockBinding("zmq.bind", imports)
    assign("zmq.bind", ipc_bind, envir = imports)
    lockBinding("zmq.bind", imports)
})
IRkernel::main()
