// The Java kernel's engine (keepstate/agent/interpreter/java_kernel.py starts it): JShell, with snippets run in
// this JVM ("local" execution, so no JDI socket that a checkpoint could drop), driven over two pipes whose file
// descriptors are its arguments (not stdin and stdout, which the snippets' child processes may inherit).
//
// Requests, one a line, every field base64: EVAL code | SETENV name value | UNSETENV name (the environment and
// the system property of that name).
// Answers, one a line, every field base64: READY once at start; for each request any of
//   OUT bytes | ERR bytes            what the snippets wrote to System.out / System.err (UTF-8, split anywhere)
//   RESULT text                      the value of the cell's last snippet, if it is an expression
//   ERROR name value traceback       the first failure; the snippets after it are not run
// and then DONE. SIGINT stops the running snippet (ERROR Interrupted).

import java.io.BufferedReader;
import java.io.ByteArrayInputStream;
import java.io.ByteArrayOutputStream;
import java.io.FileInputStream;
import java.io.FileOutputStream;
import java.io.InputStreamReader;
import java.io.OutputStream;
import java.io.PrintStream;
import java.lang.reflect.Field;
import java.nio.charset.StandardCharsets;
import java.util.Base64;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.stream.Collectors;

import jdk.jshell.DeclarationSnippet;
import jdk.jshell.Diag;
import jdk.jshell.EvalException;
import jdk.jshell.ExpressionSnippet;
import jdk.jshell.JShell;
import jdk.jshell.JShellException;
import jdk.jshell.Snippet;
import jdk.jshell.SnippetEvent;
import jdk.jshell.SourceCodeAnalysis;
import jdk.jshell.UnresolvedReferenceException;
import jdk.jshell.VarSnippet;

public final class JShellRunner {
    // What `jshell` itself imports at start (its DEFAULT start-up), so that cells read the same.
    private static final String[] IMPORTS = {
        "java.io.*", "java.math.*", "java.net.*", "java.nio.file.*", "java.util.*", "java.util.concurrent.*",
        "java.util.function.*", "java.util.prefs.*", "java.util.regex.*", "java.util.stream.*",
    };
    private static final long FLUSH_MILLIS = 50;

    private static PrintStream answers;
    private static volatile boolean interrupted;

    private static synchronized void sendBytes(String kind, byte[]... fields) {
        StringBuilder line = new StringBuilder(kind);
        for (byte[] field : fields) {
            line.append(' ').append(Base64.getEncoder().encodeToString(field));
        }
        answers.print(line.append('\n'));
        answers.flush();
    }

    private static void send(String kind, String... fields) {
        byte[][] raw = new byte[fields.length][];
        for (int i = 0; i < fields.length; i++) {
            raw[i] = (fields[i] == null ? "" : fields[i]).getBytes(StandardCharsets.UTF_8);
        }
        sendBytes(kind, raw);
    }

    /** A snippet output stream: buffered, sent as frames when flushed, at least every FLUSH_MILLIS. */
    private static final class Frames extends OutputStream {
        private final String kind;
        private final ByteArrayOutputStream buffer = new ByteArrayOutputStream();

        Frames(String kind) {
            this.kind = kind;
        }

        @Override
        public synchronized void write(int b) {
            buffer.write(b);
        }

        @Override
        public synchronized void write(byte[] b, int off, int len) {
            buffer.write(b, off, len);
            if (buffer.size() >= 1 << 16) {
                flush();
            }
        }

        @Override
        public synchronized void flush() {
            if (buffer.size() > 0) {
                sendBytes(kind, buffer.toByteArray());
                buffer.reset();
            }
        }
    }

    public static void main(String[] args) throws Exception {
        BufferedReader requests = new BufferedReader(new InputStreamReader(
            new FileInputStream("/proc/self/fd/" + Integer.parseInt(args[0])), StandardCharsets.UTF_8));
        answers = new PrintStream(new FileOutputStream("/proc/self/fd/" + Integer.parseInt(args[1])), false,
            StandardCharsets.UTF_8);
        Frames out = new Frames("OUT");
        Frames err = new Frames("ERR");
        PrintStream userOut = new PrintStream(out, false, StandardCharsets.UTF_8);
        PrintStream userErr = new PrintStream(err, false, StandardCharsets.UTF_8);
        System.setOut(userOut);
        System.setErr(userErr);
        System.setIn(new ByteArrayInputStream(new byte[0]));
        Thread flusher = new Thread(() -> {
            while (true) {
                try {
                    Thread.sleep(FLUSH_MILLIS);
                } catch (InterruptedException e) {
                    return;
                }
                userOut.flush();
                userErr.flush();
            }
        }, "keepstate-flush");
        flusher.setDaemon(true);
        flusher.start();

        JShell shell = JShell.builder().executionEngine("local").out(userOut).err(userErr)
            .in(new ByteArrayInputStream(new byte[0])).build();
        for (String name : IMPORTS) {
            shell.eval("import " + name + ";");
        }
        sun.misc.Signal.handle(new sun.misc.Signal("INT"), signal -> {
            interrupted = true;
            // JShell's stop ends loops (it instruments them), not a thread that waits: interrupt that.
            for (Thread thread : Thread.getAllStackTraces().keySet()) {
                for (ThreadGroup group = thread.getThreadGroup(); group != null; group = group.getParent()) {
                    if (group.getName().startsWith("JShell")) {
                        thread.interrupt();
                        break;
                    }
                }
            }
            shell.stop();
        });

        send("READY");
        String line;
        while ((line = requests.readLine()) != null) {
            String[] parts = line.split(" ", -1);
            try {
                switch (parts[0]) {
                    case "EVAL" -> eval(shell, decode(parts[1]));
                    // Both the environment and a system property: E2B's Java kernel gives env vars as
                    // System.getProperty(name), and System.getenv is what Java users would try first.
                    case "SETENV" -> {
                        environment().put(decode(parts[1]), decode(parts[2]));
                        System.setProperty(decode(parts[1]), decode(parts[2]));
                    }
                    case "UNSETENV" -> {
                        environment().remove(decode(parts[1]));
                        System.clearProperty(decode(parts[1]));
                    }
                    default -> send("ERROR", "ProtocolError", "unknown request " + parts[0], "");
                }
            } catch (Exception e) {
                send("ERROR", e.getClass().getName(), String.valueOf(e.getMessage()), stackTrace(e));
            } finally {
                userOut.flush();
                userErr.flush();
                send("DONE");
            }
        }
    }

    private static String decode(String field) {
        return new String(Base64.getDecoder().decode(field), StandardCharsets.UTF_8);
    }

    /** Runs the cell's snippets in order, up to the first failure. */
    private static void eval(JShell shell, String code) {
        interrupted = false;
        SourceCodeAnalysis analysis = shell.sourceCodeAnalysis();
        String remaining = code;
        String result = null;
        while (!remaining.isBlank()) {
            SourceCodeAnalysis.CompletionInfo info = analysis.analyzeCompletion(remaining);
            String source;
            if (info.completeness() == SourceCodeAnalysis.Completeness.EMPTY) {
                break;
            } else if (info.completeness().isComplete()) {
                source = info.source();
                remaining = info.remaining();
            } else {
                source = remaining; // incomplete: JShell's diagnostics say what is missing
                remaining = "";
            }
            result = null;
            for (SnippetEvent event : shell.eval(source)) {
                if (event.causeSnippet() != null) {
                    continue; // an update of another snippet this one affected
                }
                Snippet snippet = event.snippet();
                if (event.status() == Snippet.Status.REJECTED) {
                    reject(shell, snippet);
                    return;
                }
                if (interrupted) {
                    send("ERROR", "Interrupted", "the execution was interrupted", "");
                    return;
                }
                if (event.exception() != null) {
                    fail(shell, event.exception());
                    return;
                }
                if (event.value() != null && (snippet.kind() == Snippet.Kind.EXPRESSION
                        || snippet.subKind() == Snippet.SubKind.TEMP_VAR_EXPRESSION_SUBKIND)) {
                    result = isString(snippet) ? unescape(event.value()) : event.value();
                }
            }
        }
        if (result != null) {
            send("RESULT", result);
        }
    }

    private static boolean isString(Snippet snippet) {
        String type = snippet instanceof VarSnippet var ? var.typeName()
            : snippet instanceof ExpressionSnippet expression ? expression.typeName() : "";
        return type.equals("String") || type.equals("java.lang.String");
    }

    /** A String value as jshell shows it ("a\"b\n") with its escapes undone, still quoted: the bridge strips the
     * quotes of a text result, as of Python's repr. */
    private static String unescape(String shown) {
        if (shown.length() < 2 || shown.charAt(0) != '"' || shown.charAt(shown.length() - 1) != '"') {
            return shown; // null
        }
        StringBuilder text = new StringBuilder("\"");
        for (int i = 1; i < shown.length() - 1; i++) {
            char c = shown.charAt(i);
            if (c != '\\' || i + 1 >= shown.length() - 1) {
                text.append(c);
                continue;
            }
            char next = shown.charAt(++i);
            switch (next) {
                case 'n' -> text.append('\n');
                case 't' -> text.append('\t');
                case 'r' -> text.append('\r');
                case 'b' -> text.append('\b');
                case 'f' -> text.append('\f');
                default -> {
                    if (next >= '0' && next <= '7') {
                        int end = i;
                        while (end < Math.min(i + 3, shown.length() - 1) && shown.charAt(end) >= '0'
                                && shown.charAt(end) <= '7') {
                            end++;
                        }
                        text.append((char) Integer.parseInt(shown.substring(i, end), 8));
                        i = end - 1;
                    } else {
                        text.append(next);
                    }
                }
            }
        }
        return text.append('"').toString();
    }

    private static void reject(JShell shell, Snippet snippet) {
        List<Diag> diags = shell.diagnostics(snippet).filter(Diag::isError).collect(Collectors.toList());
        if (diags.isEmpty()) {
            diags = shell.diagnostics(snippet).collect(Collectors.toList());
        }
        String source = snippet.source();
        StringBuilder trace = new StringBuilder();
        for (Diag diag : diags) {
            trace.append("error: ").append(diag.getMessage(Locale.ROOT)).append('\n');
            long pos = diag.getStartPosition();
            if (pos >= 0 && pos <= source.length()) {
                int start = source.lastIndexOf('\n', (int) Math.max(pos - 1, 0)) + 1;
                int end = source.indexOf('\n', (int) pos);
                String text = source.substring(start, end < 0 ? source.length() : end);
                trace.append(text).append('\n').append(" ".repeat((int) pos - start)).append("^\n");
            }
        }
        String first = diags.isEmpty() ? "the snippet was rejected" : diags.get(0).getMessage(Locale.ROOT);
        send("ERROR", "CompilationException", first, trace.toString().stripTrailing());
    }

    private static void fail(JShell shell, JShellException exception) {
        if (exception instanceof EvalException eval) {
            String value = eval.getMessage() == null ? "" : eval.getMessage();
            send("ERROR", eval.getExceptionClassName(), value, stackTrace(eval));
        } else if (exception instanceof UnresolvedReferenceException unresolved) {
            DeclarationSnippet snippet = unresolved.getSnippet();
            String missing = shell.unresolvedDependencies(snippet).collect(Collectors.joining(", "));
            String value = "attempted to use " + snippet.name() + ", which cannot be invoked until "
                + missing + " is declared";
            send("ERROR", "UnresolvedReferenceException", value, value);
        } else {
            send("ERROR", exception.getClass().getName(), String.valueOf(exception.getMessage()),
                stackTrace(exception));
        }
    }

    /** A Java-style trace, of the user's frames: JShell's own (below the snippet) are left out. */
    private static String stackTrace(Throwable error) {
        StringBuilder trace = new StringBuilder();
        for (Throwable t = error; t != null; t = t.getCause()) {
            String name = t instanceof EvalException eval ? eval.getExceptionClassName() : t.getClass().getName();
            trace.append(t == error ? "" : "Caused by: ").append(name);
            if (t.getMessage() != null) {
                trace.append(": ").append(t.getMessage());
            }
            trace.append('\n');
            for (StackTraceElement frame : t.getStackTrace()) {
                String cls = frame.getClassName();
                if (cls.startsWith("jdk.jshell.") || cls.startsWith("jdk.internal.reflect.")
                        || cls.startsWith("java.lang.reflect.")) {
                    break;
                }
                trace.append("\tat ").append(frame).append('\n');
            }
            if (t.getCause() == t) {
                break;
            }
        }
        return trace.toString().stripTrailing();
    }

    /** The JVM's own environment map (System.getenv, ProcessBuilder), which Java offers no way to change. */
    @SuppressWarnings("unchecked")
    private static Map<String, String> environment() throws ReflectiveOperationException {
        Class<?> processEnvironment = Class.forName("java.lang.ProcessEnvironment");
        Field unmodifiable = processEnvironment.getDeclaredField("theUnmodifiableEnvironment");
        unmodifiable.setAccessible(true);
        Object view = unmodifiable.get(null);
        Field inner = view.getClass().getDeclaredField("m");
        inner.setAccessible(true);
        return (Map<String, String>) inner.get(view);
    }
}
