// The stock E2B JS SDK (`e2b` from npm, pinned in package-lock.json) against a KeepState server with real gVisor
// sandboxes. Run by tests/sdk/test_js_sdk.py with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY set; by hand:
//   E2B_API_URL=... E2B_SANDBOX_URL=... E2B_API_KEY=... node --test tests/js/*.test.mjs
// Scenarios are independent and run concurrently; each kills what it creates.

import { after, before, describe, it } from 'node:test'
import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'

// The package has no "exports" map, so a bare `import 'e2b'` loads its CommonJS build, which require()s the
// ESM-only chalk: that needs require(esm), Node >= 20.19. Debian 12's nodejs is 18.20, so import the ESM build
// (the package's "module" entry, the same code) directly.
import { CommandExitError, FileType, FilesystemEventType, NotFoundError, Sandbox } from 'e2b/dist/index.mjs'

const TAG = randomUUID().slice(0, 8) // this run's sandboxes, in metadata, so listing finds only ours
const TIMEOUT_MS = 300_000 // each sandbox's lifetime: a crashed run's sandboxes expire on their own
const STEP = { timeout: 120_000 } // a hung request fails its scenario instead of hanging the run

const made = new Set() // every sandbox a scenario creates, killed at the end whatever happened

async function create(role, opts = {}) {
  const sbx = await Sandbox.create({ timeoutMs: TIMEOUT_MS, ...opts, metadata: { suite: TAG, role, ...opts.metadata } })
  made.add(sbx)
  return sbx
}

function adopt(sbx) {
  made.add(sbx)
  return sbx
}

// A bound on how long we wait for something to happen (never a guess at how long it takes).
function within(ms, promise, what) {
  let timer
  const expired = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`gave up after ${ms} ms waiting for ${what}`)), ms)
  })
  return Promise.race([promise, expired]).finally(() => clearTimeout(timer))
}

// Polls `probe` until it returns something truthy and returns that; for effects that land asynchronously.
async function waitUntil(probe, ms, what, everyMs = 250) {
  const deadline = Date.now() + ms
  for (;;) {
    const value = await probe()
    if (value) return value
    if (Date.now() >= deadline) throw new Error(`gave up after ${ms} ms waiting for ${what} (last: ${JSON.stringify(value)})`)
    await new Promise((resolve) => setTimeout(resolve, everyMs))
  }
}

describe('e2b JS SDK against KeepState', { concurrency: true }, () => {
  after(async () => {
    await Promise.allSettled([...made].map((sbx) => sbx.kill()))
  }, STEP)

  describe('one sandbox created with metadata and envs', { concurrency: true }, () => {
    let sbx
    const greeting = `hello-${TAG}`
    before(async () => {
      sbx = await create('shared', { metadata: { flavour: 'plain' }, envs: { KS_GREETING: greeting } })
    }, STEP)

    it('sees the envs given at creation in its commands', STEP, async () => {
      const r = await sbx.commands.run('printf %s "$KS_GREETING"')
      assert.equal(r.stdout, greeting)
    })

    it('commands.run reports stdout, stderr and the exit code', STEP, async () => {
      const r = await sbx.commands.run('echo out-$((40+2)); echo err-$((6*7)) >&2')
      assert.equal(r.stdout, 'out-42\n')
      assert.equal(r.stderr, 'err-42\n')
      assert.equal(r.exitCode, 0)
    })

    it('a non-zero exit raises CommandExitError', STEP, async () => {
      await assert.rejects(sbx.commands.run('echo failing >&2; exit 3'), (err) => {
        assert.ok(err instanceof CommandExitError, `expected CommandExitError, got ${err}`)
        assert.equal(err.exitCode, 3)
        assert.equal(err.stderr, 'failing\n')
        return true
      })
    })

    it('a background command reads what sendStdin sends, and EOF on closeStdin', STEP, async () => {
      const handle = await sbx.commands.run('read line; echo "got:$line"; wc -c', { background: true, stdin: true })
      assert.ok(handle.pid > 0)
      await sbx.commands.sendStdin(handle.pid, `first-${TAG}\n`)
      await handle.sendStdin('12345')
      await handle.closeStdin() // `wc -c` ends only on EOF
      const r = await within(30_000, handle.wait(), 'the background command to exit after closeStdin')
      assert.equal(r.exitCode, 0)
      assert.deepEqual(r.stdout.split('\n').map((s) => s.trim()), [`got:first-${TAG}`, '5', ''])
    })

    it('files: write, read, list, exists, rename, remove', STEP, async () => {
      const dir = `/home/user/files-${TAG}`
      await sbx.files.makeDir(dir)
      await sbx.files.write(`${dir}/a.txt`, `content ${TAG}`)
      await sbx.files.write(`${dir}/b.bin`, new Uint8Array([0, 1, 2, 255]).buffer)
      assert.equal(await sbx.files.read(`${dir}/a.txt`), `content ${TAG}`)
      assert.deepEqual([...(await sbx.files.read(`${dir}/b.bin`, { format: 'bytes' }))], [0, 1, 2, 255])
      // what the files API wrote is what a process in the sandbox sees
      assert.equal((await sbx.commands.run(`cat ${dir}/a.txt`)).stdout, `content ${TAG}`)

      const listed = (await sbx.files.list(dir)).map((e) => [e.name, e.type]).sort()
      assert.deepEqual(listed, [['a.txt', FileType.FILE], ['b.bin', FileType.FILE]])
      assert.equal(await sbx.files.exists(`${dir}/a.txt`), true)
      assert.equal(await sbx.files.exists(`${dir}/missing.txt`), false)

      const moved = await sbx.files.rename(`${dir}/a.txt`, `${dir}/c.txt`)
      assert.equal(moved.path, `${dir}/c.txt`)
      assert.equal(await sbx.files.exists(`${dir}/a.txt`), false)
      assert.equal(await sbx.files.read(`${dir}/c.txt`), `content ${TAG}`)

      await sbx.files.remove(`${dir}/c.txt`)
      assert.equal(await sbx.files.exists(`${dir}/c.txt`), false)
      assert.deepEqual((await sbx.files.list(dir)).map((e) => e.name), ['b.bin'])
    })

    it('files.watchDir sees a write', STEP, async () => {
      const dir = `/home/user/watched-${TAG}`
      await sbx.files.makeDir(dir)
      const events = []
      let seen
      const written = new Promise((resolve) => { seen = resolve })
      const handle = await sbx.files.watchDir(dir, (ev) => {
        events.push(`${ev.type}:${ev.name}`)
        if (ev.name === 'new.txt' && ev.type === FilesystemEventType.WRITE) seen()
      })
      try {
        await sbx.files.write(`${dir}/new.txt`, 'watched')
        await within(30_000, written, `a write event for new.txt (events so far: ${JSON.stringify(events)})`)
        assert.ok(events.includes(`${FilesystemEventType.CREATE}:new.txt`), `no create event in ${JSON.stringify(events)}`)
      } finally {
        await handle.stop()
      }
    })

    it('a PTY runs a shell that answers sendInput', STEP, async () => {
      const decoder = new TextDecoder()
      let output = ''
      let answered
      const answer = new Promise((resolve) => { answered = resolve })
      const pty = await sbx.pty.create({
        cols: 80,
        rows: 24,
        onData: (data) => {
          output += decoder.decode(data, { stream: true })
          if (output.includes('pty-42')) answered() // the shell evaluated the input: its echo is pty-$((6*7))
        },
      })
      await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('echo pty-$((6*7))\n'))
      await within(30_000, answer, `the shell's answer in the PTY (output so far: ${JSON.stringify(output)})`)
      await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('exit 0\n'))
      const r = await within(30_000, pty.wait(), 'the PTY shell to exit')
      assert.equal(r.exitCode, 0)
    })

    it('getInfo and Sandbox.list describe it', STEP, async () => {
      const info = await sbx.getInfo()
      assert.equal(info.sandboxId, sbx.sandboxId)
      assert.deepEqual(info.metadata, { suite: TAG, role: 'shared', flavour: 'plain' })
      assert.equal(info.state, 'running')
      assert.ok(info.startedAt < info.endAt, `startedAt ${info.startedAt} is not before endAt ${info.endAt}`)
      assert.equal(await sbx.isRunning(), true)

      const byStatic = await Sandbox.getInfo(sbx.sandboxId)
      assert.equal(byStatic.sandboxId, sbx.sandboxId)
      assert.equal(byStatic.templateId, info.templateId)

      const listed = await Sandbox.list({ query: { metadata: { suite: TAG, role: 'shared' } } }).nextItems()
      assert.deepEqual(listed.map((s) => s.sandboxId), [sbx.sandboxId])
      assert.deepEqual(listed[0].metadata, info.metadata)
      const none = await Sandbox.list({ query: { metadata: { suite: TAG, role: 'no-such-role' } } }).nextItems()
      assert.deepEqual(none, [])
    })

    it('setTimeout moves its end', STEP, async () => {
      const previous = (await sbx.getInfo()).endAt
      const asked = Date.now()
      await sbx.setTimeout(900_000)
      const end = (await sbx.getInfo()).endAt
      assert.ok(end > previous, `endAt did not move: ${previous} -> ${end}`)
      const off = Math.abs(end.getTime() - (asked + 900_000))
      assert.ok(off < 60_000, `endAt ${end.toISOString()} is ${off} ms away from 900 s after the call`)
    })

    it('getMetrics reports real figures', STEP, async () => {
      const metrics = await waitUntil(async () => {
        const m = await sbx.getMetrics()
        return m.length > 0 && m
      }, 40_000, 'a first metrics sample', 1000)
      const m = metrics.at(-1)
      assert.ok(m.memUsed > 1024 * 1024, `memUsed ${m.memUsed}`) // an agent runs in there
      assert.ok(m.memTotal >= m.memUsed, `memTotal ${m.memTotal} < memUsed ${m.memUsed}`)
      assert.ok(m.cpuCount >= 1, `cpuCount ${m.cpuCount}`)
      assert.ok(m.cpuUsedPct >= 0, `cpuUsedPct ${m.cpuUsedPct}`)
      assert.ok(m.timestamp instanceof Date && !Number.isNaN(m.timestamp.getTime()))
    })
  })

  it('pause, then Sandbox.connect resumes it with its files and processes', STEP, async () => {
    const sbx = await create('pause')
    await sbx.files.write('/home/user/kept.txt', `kept ${TAG}`)
    const sleeper = await sbx.commands.run('sleep 3600', { background: true })
    assert.equal(await sbx.pause(), true)
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused')

    const resumed = adopt(await Sandbox.connect(sbx.sandboxId, { timeoutMs: TIMEOUT_MS }))
    assert.equal(resumed.sandboxId, sbx.sandboxId)
    assert.equal((await resumed.getInfo()).state, 'running')
    assert.equal(await resumed.files.read('/home/user/kept.txt'), `kept ${TAG}`)
    const pids = (await resumed.commands.list()).map((p) => p.pid)
    assert.ok(pids.includes(sleeper.pid), `the background sleep (pid ${sleeper.pid}) is gone after resume: ${pids}`)
  })

  it('kill, then the sandbox is gone', STEP, async () => {
    const sbx = await create('kill')
    const id = sbx.sandboxId
    assert.equal(await sbx.isRunning(), true)
    assert.equal(await sbx.kill(), true)
    assert.equal(await sbx.isRunning(), false)
    await assert.rejects(Sandbox.getInfo(id), NotFoundError)
    assert.equal(await Sandbox.kill(id), false)
    const listed = await Sandbox.list({ query: { metadata: { suite: TAG, role: 'kill' } } }).nextItems()
    assert.deepEqual(listed, [])
  })

  it('fork: the forks see the parent\'s files and diverge', STEP, async () => {
    const parent = await create('fork-parent')
    await parent.files.write('/home/user/branch.txt', 'base')
    const forks = await parent.fork({ count: 2, timeoutMs: 120_000 })
    forks.filter((f) => f instanceof Sandbox).forEach(adopt)
    assert.equal(forks.length, 2)
    forks.forEach((f) => assert.ok(f instanceof Sandbox, `a fork failed: ${f}`))
    const ids = new Set(forks.map((f) => f.sandboxId))
    assert.equal(ids.size, 2)
    assert.ok(!ids.has(parent.sandboxId))

    await Promise.all(forks.map(async (f, i) => {
      assert.equal(await f.files.read('/home/user/branch.txt'), 'base')
      await f.files.write('/home/user/branch.txt', `fork ${i}`)
    }))
    await parent.files.write('/home/user/after-fork.txt', 'parent only')
    for (const [i, f] of forks.entries()) {
      assert.equal(await f.files.read('/home/user/branch.txt'), `fork ${i}`)
      assert.equal(await f.files.exists('/home/user/after-fork.txt'), false)
      assert.equal((await f.commands.run('cat /home/user/branch.txt')).stdout, `fork ${i}`)
    }
    assert.equal(await parent.files.read('/home/user/branch.txt'), 'base') // the parent is untouched, and runs on
    assert.equal((await parent.getInfo()).state, 'running')

    // Sandbox.fork by ID, and a fork connected to by its ID like any sandbox
    const [byId] = await Sandbox.fork(parent.sandboxId, { count: 1, timeoutMs: 120_000 })
    assert.ok(byId instanceof Sandbox, `the fork by ID failed: ${byId}`)
    adopt(byId)
    const again = await Sandbox.connect(byId.sandboxId)
    assert.equal(await again.files.read('/home/user/after-fork.txt'), 'parent only')
  })

  it('snapshots: a sandbox created from one has its files', STEP, async () => {
    const sbx = await create('snapshot')
    await sbx.files.write('/home/user/snap.txt', `in the snapshot ${TAG}`)
    const snap = await sbx.createSnapshot()
    let deleted
    try {
      assert.ok(snap.snapshotId, `no snapshotId in ${JSON.stringify(snap)}`)
      await sbx.files.write('/home/user/snap.txt', 'after the snapshot') // the source runs on, and diverges
      const ofSandbox = await Sandbox.listSnapshots({ sandboxId: sbx.sandboxId }).nextItems()
      assert.deepEqual(ofSandbox.map((s) => s.snapshotId), [snap.snapshotId])
      const fromInstance = await sbx.listSnapshots().nextItems()
      assert.deepEqual(fromInstance.map((s) => s.snapshotId), [snap.snapshotId])

      const child = adopt(await Sandbox.create(snap.snapshotId, { timeoutMs: TIMEOUT_MS }))
      assert.notEqual(child.sandboxId, sbx.sandboxId)
      assert.equal(await child.files.read('/home/user/snap.txt'), `in the snapshot ${TAG}`)
      assert.equal(await sbx.files.read('/home/user/snap.txt'), 'after the snapshot')
    } finally {
      deleted = await Sandbox.deleteSnapshot(snap.snapshotId).catch((err) => err) // never hides the failure above
    }
    assert.equal(deleted, true)
    assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId), false)
    assert.deepEqual(await Sandbox.listSnapshots({ sandboxId: sbx.sandboxId }).nextItems(), [])
  })
})
