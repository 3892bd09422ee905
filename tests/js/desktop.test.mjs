// Desktops with the stock `@e2b/desktop` JS SDK (docs/design/desktop.md): `Sandbox.create()` picks the `desktop`
// template and starts X and XFCE; a screenshot is a PNG of the screen's size that changes once an application
// opens; the mouse and the keyboard reach the screen; `launch` opens Chromium on a page served inside the sandbox;
// the stream's noVNC page answers on the 6080 port URL (through the server's listener, the port URL as Host).

import { after, describe, it } from 'node:test'
import assert from 'node:assert/strict'

import { Sandbox } from '@e2b/desktop'

import { get } from './port_url.mjs'

const STEP = { timeout: 180_000 }

const pngSize = (bytes) => {
  assert.deepEqual([...bytes.subarray(0, 8)], [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a])
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength)
  return [view.getUint32(16), view.getUint32(20)] // IHDR's width and height
}

async function until(what, probe, ms = 90_000) {
  const deadline = Date.now() + ms
  for (;;) {
    const value = await probe()
    if (value) return value
    if (Date.now() > deadline) throw new Error(`gave up after ${ms / 1000} s waiting for ${what}`)
    await new Promise((resolve) => setTimeout(resolve, 500))
  }
}

describe('desktop (JS SDK)', () => {
  let desk
  after(async () => { if (desk) await desk.kill() }, STEP)

  it('screen, mouse, keyboard, a browser window and the stream page', STEP, async () => {
    desk = await Sandbox.create({ timeoutMs: 600_000 })
    const first = await desk.screenshot()
    assert.deepEqual(pngSize(first), [1024, 768])
    assert.deepEqual(await desk.getScreenSize(), { width: 1024, height: 768 })
    await desk.moveMouse(222, 111)
    assert.deepEqual(await desk.getCursorPosition(), { x: 222, y: 111 })

    await desk.launch('xfce4-terminal')
    await until('a terminal with its shell', async () => {
      const ids = await desk.getApplicationWindows('xfce4-terminal').catch(() => [])
      for (const id of ids) if ((await desk.getWindowTitle(id)).includes('user@')) return true
      return false
    })
    await desk.write('echo typed-from-js > /tmp/js-typed')
    await desk.press('enter')
    await until('the typed command to run', async () =>
      (await desk.commands.run('cat /tmp/js-typed 2>/dev/null || true')).stdout === 'typed-from-js\n', 30_000)

    await desk.files.write('/home/user/site/index.html', '<title>KS:js</title><h1>hello from js</h1>')
    await desk.commands.run('cd /home/user/site && python3 -m http.server 8000', { background: true, timeoutMs: 0 })
    await until('the page server', async () =>
      (await desk.commands.run('curl -fsS -o /dev/null http://localhost:8000/ && echo up || true')).stdout.trim() === 'up')
    await desk.launch('google-chrome', 'http://localhost:8000/')
    const window = await until('a Chromium window on the page', async () => {
      const ids = await desk.getApplicationWindows('Google-chrome').catch(() => [])
      for (const id of ids) if ((await desk.getWindowTitle(id)).startsWith('KS:js')) return id
      return null
    })
    assert.ok(window)
    const after = await desk.screenshot()
    assert.deepEqual(pngSize(after), [1024, 768])
    assert.notDeepEqual(Buffer.from(after), Buffer.from(first))

    await desk.stream.start({ requireAuth: true })
    const key = desk.stream.getAuthKey()
    const url = new URL(desk.stream.getUrl({ authKey: key, viewOnly: true }))
    assert.equal(url.protocol, 'https:')
    assert.equal(url.hostname.split('.')[0], `6080-${desk.sandboxId}`)
    assert.equal(url.searchParams.get('view_only'), 'true')
    assert.equal(url.searchParams.get('password'), key)
    const page = await get(desk.getHost(6080), '/vnc.html')
    assert.equal(page.status, 200)
    assert.match(page.body, /noVNC/)
    await desk.stream.stop()
  })
})
